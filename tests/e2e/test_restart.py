"""A real server killed with SIGKILL and restarted on the same state file loses nothing it acknowledged."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def right_answer(s: dict[str, Any]) -> str:
    if s["dataset_id"] == "add":
        return str(eval(s["metadata"]["expression"]))
    return "?"


def test_restart_after_kill_keeps_batches_grades_and_gate_state(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.db"
    args = [str(curriculum_file), "--database-url", str(state), "--grader-workers", "1"]
    server = server_process(args)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        batches = {}
        grades = []
        for i in range(3):
            batches[i] = c.post("/sample", json={"iteration": i, "batch_size": 4}).json()
            items = [{"sample_id": s["sample_id"], "completion": right_answer(s)} for s in batches[i]["samples"]]
            if i < 2:  # iteration 2 is where the gate fires (min_steps 2), so it is never graded
                grades.append((i, items, c.post("/grade", json={"iteration": i, "items": items}).json()))
        before = c.get("/curriculum").json()
        assert before["current_stage"] == "main"
    server.kill()

    server = server_process(args)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for i, batch in batches.items():
            assert c.post("/sample", json={"iteration": i, "batch_size": 4}).json() == batch
        for i, items, results in grades:
            again = c.post("/grade", json={"iteration": i, "items": items}).json()["results"]
            assert [r["reward"] for r in again] == [r["reward"] for r in results["results"]]
            assert all(r["cached"] for r in again)
        after = c.get("/curriculum").json()
        assert after == before
        # The next iteration continues in the stage the gate chose before the crash.
        assert c.post("/sample", json={"iteration": 3, "batch_size": 4}).json()["stage"] == "main"
        # A grade without `iteration` for a sample served before the crash counts for the stage that served it.
        first = batches[2]["samples"][0]
        c.post("/grade", json={"items": [{"sample_id": first["sample_id"], "completion": "x"}]})
        stages = {s["name"]: s for s in c.get("/curriculum").json()["stages"]}
        assert stages["main"]["graded"] == 1


def test_kill_at_a_random_moment_loses_no_acknowledged_grade(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.db"
    args = [str(curriculum_file), "--database-url", str(state), "--grader-workers", "1"]
    server = server_process(args)
    acknowledged_samples: dict[int, Any] = {}
    acknowledged_grades: list[tuple[int, list[dict[str, Any]], list[dict[str, Any]]]] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(base_url=server.url, timeout=5) as c:
            i = 0
            while not stop.is_set():
                try:
                    batch = c.post("/sample", json={"iteration": i, "batch_size": 4}).json()
                    acknowledged_samples[i] = batch
                    items = [{"sample_id": s["sample_id"], "completion": str(i)} for s in batch["samples"]]
                    response = c.post("/grade", json={"iteration": i, "items": items})
                    if response.status_code == 200:
                        acknowledged_grades.append((i, items, response.json()["results"]))
                except httpx.TransportError:
                    return  # the server is gone: whatever was acknowledged so far is what counts
                i += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    time.sleep(random.uniform(0.5, 1.5))
    server.kill()
    stop.set()
    thread.join(timeout=10)
    assert acknowledged_grades, "the server should have acknowledged some grades before the kill"

    server = server_process(args)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for i, batch in acknowledged_samples.items():
            assert c.post("/sample", json={"iteration": i, "batch_size": 4}).json() == batch
        graded = 0
        for i, items, results in acknowledged_grades:
            again = c.post("/grade", json={"iteration": i, "items": items}).json()["results"]
            assert all(r["cached"] for r in again), i
            assert [r["reward"] for r in again] == [r["reward"] for r in results]
            graded += len(items)
        state_after = c.get("/curriculum").json()
    counted = sum(s["graded"] + s["errors"] for s in state_after["stages"])
    assert counted >= graded


def test_a_state_file_of_another_curriculum_is_refused(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.db"
    server = server_process([str(curriculum_file), "--database-url", str(state), "--grader-workers", "1"])
    httpx.post(server.url + "/sample", json={"iteration": 0, "batch_size": 2})
    server.stop()
    with pytest.raises(RuntimeError, match="server exited with 2") as info:
        server_process([str(curriculum_file), "--database-url", str(state), "--seed", "6", "--grader-workers", "1"])
    assert "belongs to curriculum 'tiny'" in str(info.value)
    assert "start a new run with another --run name or --database-url path (PROCTOR_RUN, PROCTOR_DATABASE_URL)" in str(
        info.value
    )


def test_a_second_server_on_the_same_state_is_refused_or_stands_by(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path, database: str
) -> None:
    """A state file serves one process: a second is refused. A second server of a PostgreSQL database stands by:
    it forwards to the first, and serves once the first is gone."""
    state = tmp_path / "state.db"
    args = [str(curriculum_file), "--database-url", str(state), "--grader-workers", "1"]
    first = server_process(args)
    batch = httpx.post(first.url + "/sample", json={"iteration": 0, "batch_size": 2})
    assert batch.status_code == 200, batch.text
    if database == "sqlite":
        with pytest.raises(RuntimeError, match="server exited with 2") as info:
            server_process(args)
        assert f"state file {state} is in use by another proctor serve" in str(info.value)
        assert "Traceback" not in str(info.value)
        # The first serves on, and once it is gone (however it went) the file is free.
        assert httpx.post(first.url + "/sample", json={"iteration": 0, "batch_size": 2}).json() == batch.json()
        first.kill()
        second = server_process(args)
    else:
        second = server_process(args)
        assert httpx.post(second.url + "/sample", json={"iteration": 0, "batch_size": 2}).json() == batch.json()
        first.kill()
    # However the second came to serve, it serves the run the first left.
    again = httpx.post(second.url + "/sample", json={"iteration": 0, "batch_size": 2}, timeout=30)
    for _ in range(100):  # a standby takes over within seconds; a liveness bound, not a timing claim
        if again.status_code != 503:
            break
        time.sleep(0.2)
        again = httpx.post(second.url + "/sample", json={"iteration": 0, "batch_size": 2}, timeout=30)
    assert again.json() == batch.json()


def test_fresh_is_refused_while_a_server_holds_the_state_file(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path, state_target: Callable[[str], str]
) -> None:
    state = tmp_path / "state.db"
    first = server_process([str(curriculum_file), "--database-url", str(state), "--grader-workers", "1"])
    batch = httpx.post(first.url + "/sample", json={"iteration": 0, "batch_size": 2}).json()
    # On another port: only the file says that a server runs this state.
    with pytest.raises(RuntimeError, match="server exited with 2") as info:
        server_process([str(curriculum_file), "--database-url", str(state), "--fresh", "--grader-workers", "1"])
    target = state_target(str(state))
    if target.startswith("postgresql://"):
        # A database is never removed: --fresh says how to start over.
        assert f"--fresh removes a state file, and the state is the PostgreSQL database {target}" in str(info.value)
    else:
        assert f"--fresh: state file {state} is in use by another proctor serve" in str(info.value)
    assert httpx.post(first.url + "/sample", json={"iteration": 0, "batch_size": 2}).json() == batch
