"""Hung graders on a real server: /grade reports timeouts, /healthz and /sample keep answering meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_hung_graders_do_not_stall_the_server(server_process: Callable[..., Any], curriculum_file: Path) -> None:
    server = server_process(
        [str(curriculum_file), "--database-url", ":memory:", "--grader-workers", "2"],
        env={"PROCTOR_GRADER_TIMEOUT_S": "1"},
    )
    meta = httpx.get(server.url + "/meta").json()
    version = next(s["version"] for s in meta["sources"] if s["name"] == "slowpoke")
    results: list[httpx.Response] = []

    def post_hung_grades(n: int) -> None:
        items = [{"sample_id": f"slowpoke:{version}:{n * 10 + k}", "completion": "1"} for k in range(3)]
        results.append(httpx.post(server.url + "/grade", json={"items": items}, timeout=30))

    # Four requests × three hung completions on two workers: the pool is saturated for about six seconds.
    threads = [threading.Thread(target=post_hung_grades, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=5) as c:
        for i in range(20):
            started = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            assert c.post("/sample", json={"iteration": i, "batch_size": 4}).status_code == 200
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.05)
        busy = any(t.is_alive() for t in threads)
    for t in threads:
        t.join(timeout=30)
    # Not a performance claim (that is bench/'s job): a liveness bound, far above normal and far below a stall.
    assert slowest < 2.0
    assert busy, "the hung graders should still have been running while /healthz was probed"
    assert [r.status_code for r in results] == [200] * 4
    for response in results:
        for result in response.json()["results"]:
            assert result["error"] == "slow: graders did not finish within 1s"
            assert result["reward"] == -0.5
    metrics = httpx.get(server.url + "/metrics").text
    assert 'proctor_grader_errors_total{grader="slow",kind="timeout"} 12.0' in metrics
