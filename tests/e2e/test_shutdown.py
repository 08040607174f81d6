"""SIGTERM under load: in-flight /grade requests finish, the state is flushed, and after a restart every
acknowledged grade is there."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_sigterm_lets_in_flight_grades_finish_and_loses_none(
    server_process: Callable[..., Any],
    tiny_doc: dict[str, Any],
    write_tiny: Callable[[dict[str, Any]], Path],
    tmp_path: Path,
) -> None:
    # Grading takes a while, so that requests are in flight when the signal arrives.
    tiny_doc["sources"]["add"]["graders"] = ["numeric", {"name": "slow", "weight": 0, "params": {"seconds": 0.3}}]
    curriculum = write_tiny(tiny_doc)
    args = [str(curriculum), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "2"]
    server = server_process(args)

    acknowledged: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    refused: list[str] = []
    in_flight_at_signal = threading.Event()
    signalled = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(worker, 10_000, 4):
                try:
                    batch = c.post("/sample", json={"iteration": i, "batch_size": 2}).json()["samples"]
                    body = {"iteration": i, "items": [{"sample_id": s["sample_id"], "completion": "7"} for s in batch]}
                    if signalled.is_set():
                        return
                    response = c.post("/grade", json=body)
                    if signalled.is_set():
                        in_flight_at_signal.set()  # sent before the signal, answered after it
                except httpx.TransportError as exc:
                    refused.append(type(exc).__name__)
                    return
                if response.status_code == 200:
                    acknowledged.append((body, response.json()["results"]))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    signalled.set()
    server.proc.wait(timeout=60)
    for t in threads:
        t.join(timeout=60)
    log = server.output()
    assert "Shutting down" in log and "stopped: grader processes ended" in log
    assert in_flight_at_signal.is_set(), "no /grade was in flight when SIGTERM arrived; the test proved nothing"
    assert acknowledged

    restarted = server_process(args)
    with httpx.Client(base_url=restarted.url, timeout=30) as c:
        for body, results in acknowledged:
            again = c.post("/grade", json=body).json()["results"]
            assert all(r["cached"] for r in again), body["iteration"]
            assert [r["reward"] for r in again] == [r["reward"] for r in results]
