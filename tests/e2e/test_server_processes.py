"""``proctor serve --workers N`` on a PostgreSQL database: N processes on one port, one serving the database and
the others standing by (grading the ``/grade`` requests of sampled steps); a process killed is replaced, and the
port answers on from what the database kept, every grade counted once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._postgresql import PostgreSQLCluster

pytestmark = pytest.mark.e2e
BATCH = 4


def serving_gauges(url: str, asks: int = 30) -> set[float]:
    """``proctor_serving`` of the processes that new connections to the port reached."""
    seen = set()
    for _ in range(asks):
        text = httpx.get(url + "/metrics", headers={"connection": "close"}, timeout=30).text
        [line] = [x for x in text.splitlines() if x.startswith("proctor_serving ")]
        seen.add(float(line.split()[1]))
    return seen


def server_processes(pid: int) -> list[int]:
    """The supervisor's server processes (not multiprocessing's resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and b"spawn_main" in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def ended(process: int, supervisor: int) -> bool:
    return process not in server_processes(supervisor)


def eventually(check: Callable[[], bool], what: str, seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds  # a liveness bound, not a timing claim
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def answered(call: Callable[[], httpx.Response]) -> httpx.Response:
    """``call()`` again while the port is between servers (a 503, or a connection refused or cut)."""
    deadline = time.monotonic() + 90
    while True:
        try:
            answer = call()
            if answer.status_code != 503:
                return answer
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def graded(url: str) -> int:
    stages = answered(partial(httpx.get, url + "/curriculum", timeout=30)).json()["stages"]
    return sum(s["graded"] + s["errors"] for s in stages)


def test_several_processes_share_the_port_and_one_killed_is_replaced(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster, tmp_path: Path
) -> None:
    database = postgresql_cluster.new_database()
    server = server_process(
        [str(curriculum_file), "--database-url", database, "--workers", "2", "--grader-workers", "1"]
    )
    url = server.url
    eventually(lambda: len(server_processes(server.pid)) == 2, "two server processes")
    # New connections reach both: the one that serves and the one that stands by.
    eventually(lambda: serving_gauges(url) == {0.0, 1.0}, "both processes answer on the port")
    sample = partial(httpx.post, url + "/sample", json={"iteration": 0, "batch_size": BATCH}, timeout=30)
    batch = answered(sample)
    assert {answered(sample).text for _ in range(6)} == {batch.text}
    items = [
        {"sample_id": s["sample_id"], "slot": n, "completion": f"{n} apples"}
        for n, s in enumerate(batch.json()["samples"])
    ]
    grade = partial(httpx.post, url + "/grade", json={"iteration": 0, "items": items}, timeout=30)
    first = answered(grade).json()["results"]
    for _ in range(6):  # through either process: the stored grades
        again = answered(grade).json()["results"]
        assert [r["reward"] for r in again] == [r["reward"] for r in first]
        assert [r["cached"] for r in again] == [True] * len(items)
    assert graded(url) == len(items)

    # Each process killed in turn: the port answers on from the database, and the supervisor starts another.
    for victim in server_processes(server.pid):
        os.kill(victim, signal.SIGKILL)
        eventually(partial(ended, victim, server.pid), "the process ended")
        assert answered(sample).text == batch.text
        assert [r["cached"] for r in answered(grade).json()["results"]] == [True] * len(items)
        eventually(lambda: len(server_processes(server.pid)) == 2, "the killed process replaced")
    assert graded(url) == len(items)
    eventually(lambda: serving_gauges(url) == {0.0, 1.0}, "both processes answer on the port again")
    nxt = answered(partial(httpx.post, url + "/sample", json={"iteration": 1, "batch_size": BATCH}, timeout=30))
    assert nxt.status_code == 200, nxt.text
    assert server.log.read_text().count("starting another") == 2


def test_the_processes_share_the_default_grader_processes(
    server_process: Callable[..., Any],
    curriculum_file: Path,
    postgresql_cluster: PostgreSQLCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The default: a grader process per core for the server, split among its processes.
    monkeypatch.delenv("PROCTOR_GRADER_WORKERS", raising=False)
    cores = len(os.sched_getaffinity(0))
    server = server_process(
        [str(curriculum_file), "--database-url", postgresql_cluster.new_database(), "--workers", "2"]
    )
    eventually(lambda: serving_gauges(server.url) == {0.0, 1.0}, "both processes answer on the port")
    started = [line for line in server.log.read_text().splitlines() if "grader processes" in line]
    assert len(started) == 2
    assert all(line.endswith(f"; {max(1, cores // 2)} grader processes") for line in started), started
