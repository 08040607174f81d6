"""A server whose PostgreSQL database goes away and comes back: 503s that say so meanwhile, then it serves on by
itself, from what the database kept, and no process exits. At start-up, a database that does not answer yet is
waited for, and one that never answers is named in the message the server stops with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._postgresql import PostgreSQLCluster, cluster
from proctor.cli.launcher import free_port

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
        server = server_process([str(curriculum_file), "--database-url", database, "--grader-workers", "1"])
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


def test_an_unreachable_database_stops_start_up_with_a_message_that_names_it(
    server_process: Callable[..., Any], curriculum_file: Path
) -> None:
    nowhere = f"postgresql://proctor:s3cret@127.0.0.1:{free_port()}/run"
    with pytest.raises(RuntimeError, match="server exited with 2") as info:
        server_process([str(curriculum_file), "--database-url", nowhere], env={"PROCTOR_STATE_WAIT_S": "0.5"})
    shown = nowhere.replace("s3cret", "***")
    assert f"the PostgreSQL database {shown} does not answer (connection failed" in str(info.value)
    assert "check that it runs and that the URL in --database-url (PROCTOR_DATABASE_URL) is right" in str(info.value)
    assert "s3cret" not in str(info.value)
    assert "Traceback" not in str(info.value)


def start_once_waited_for(pg: PostgreSQLCluster, log: Path) -> None:
    """Start the database once the server's log says it waits for it (or after 60 s, for the test to fail)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if log.exists() and "PROCTOR_STATE_WAIT_S" in log.read_text():
            break
        time.sleep(0.05)
    pg.ctl("start")


def test_start_up_waits_for_a_database_that_comes_up_after_the_server(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path
) -> None:
    with cluster() as pg:
        database = pg.new_database()
        pg.ctl("-m", "fast", "stop")
        # Started once the server waits for it, however long the server takes to get there.
        starting = threading.Thread(target=start_once_waited_for, args=(pg, tmp_path / "server-0.log"))
        starting.start()
        try:
            server = server_process(
                [str(curriculum_file), "--database-url", database], env={"PROCTOR_STATE_WAIT_S": "60"}
            )
        finally:
            starting.join()
        assert "waiting up to 60 s (PROCTOR_STATE_WAIT_S)" in server.output()
        assert httpx.post(server.url + "/sample", json={"iteration": 0, "batch_size": 2}).status_code == 200
