"""A server whose PostgreSQL database goes away and comes back: 503s that say so meanwhile, then it serves on by
itself, from what the database kept, and no process exits."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._postgresql import cluster

pytestmark = pytest.mark.e2e


def wait_for_health(url: str, seconds: float = 60.0) -> httpx.Response:
    """Poll /healthz until it answers 200; a liveness bound, not a timing claim."""
    deadline = time.monotonic() + seconds
    while True:
        answer = httpx.get(url + "/healthz", timeout=5)
        if answer.status_code == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def test_a_database_outage_is_a_503_and_the_server_recovers_by_itself(
    server_process: Callable[..., Any], curriculum_file: Path
) -> None:
    with cluster() as pg:
        database = pg.new_database()
        server = server_process([str(curriculum_file), "--state", database, "--grader-workers", "1"])
        with httpx.Client(base_url=server.url, timeout=30) as c:
            batch = c.post("/sample", json={"iteration": 0, "batch_size": 4}).json()
            items = [
                {"sample_id": s["sample_id"], "slot": n, "completion": "7"} for n, s in enumerate(batch["samples"])
            ]
            graded = c.post("/grade", json={"iteration": 0, "items": items}).json()["results"]

            pg.ctl("-m", "fast", "stop")
            # A new iteration has to be committed: the server finds the database gone.
            down = c.post("/sample", json={"iteration": 1, "batch_size": 4})
            assert down.status_code == 503, down.text
            detail = down.json()["detail"]
            assert f"the PostgreSQL database {database} stopped accepting writes" in detail
            assert detail.endswith("; reconnecting")
            health = c.get("/healthz")
            assert (health.status_code, health.json()["detail"]) == (503, detail)

            pg.ctl("start")
            assert wait_for_health(server.url).status_code == 200
            # It serves on from what the database kept: the same batch, the grades counted once.
            assert c.post("/sample", json={"iteration": 0, "batch_size": 4}).json() == batch
            again = c.post("/grade", json={"iteration": 0, "items": items}).json()["results"]
            assert [r["reward"] for r in again] == [r["reward"] for r in graded]
            assert all(r["cached"] for r in again)
            assert c.post("/sample", json={"iteration": 1, "batch_size": 4}).status_code == 200
        assert server.proc.poll() is None
