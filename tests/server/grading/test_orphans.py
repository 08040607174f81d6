"""``kill -9`` of the server: its grader processes die with it, the busy ones included."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

# A slow grader that says when it has started, and in which process.
BUSY_PY = """
import os
import time
from pathlib import Path


def slow(sample, *, seconds, marker):
    Path(marker).write_text(str(os.getpid()))
    time.sleep(seconds)
    return 1.0
"""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """State, parent pid and start time of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _children(pid: int) -> dict[int, int]:
    """Pid → start time of each child of ``pid``."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid:
                found[int(entry.name)] = stat[2]
    return found


def _alive(pid: int, started: int) -> bool:
    # A zombie has exited (nobody may reap it here); another start time is a recycled pid.
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX" and stat[2] == started


def test_kill_9_of_the_server_takes_its_busy_graders_with_it(
    server_process: Callable[..., ServerProcess],
    tiny_doc: dict[str, Any],
    write_tiny: Callable[[dict[str, Any]], Path],
    tmp_path: Path,
) -> None:
    marker = tmp_path / "grading-started"
    tiny_doc["graders"]["busy"] = {"python": "./busy.py:slow"}
    tiny_doc["sources"]["slowpoke"]["graders"] = [{"name": "busy", "params": {"seconds": 30, "marker": str(marker)}}]
    curriculum = write_tiny(tiny_doc)
    (curriculum.parent / "busy.py").write_text(BUSY_PY)
    server = server_process(
        [str(curriculum), "--database-url", ":memory:", "--grader-workers", "2"], env={"PROCTOR_GRADER_TIMEOUT_S": "60"}
    )
    version = next(s["version"] for s in httpx.get(server.url + "/meta").json()["sources"] if s["name"] == "slowpoke")

    def grade() -> None:
        with contextlib.suppress(httpx.TransportError):  # the server is killed under it
            httpx.post(
                server.url + "/grade",
                json={"items": [{"sample_id": f"slowpoke:{version}:0", "completion": "1"}]},
                timeout=60,
            )

    grading = threading.Thread(target=grade, name="grade")
    grading.start()
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the slow grader never started:\n{server.output()}"
        busy = int(marker.read_text())
        workers = _children(server.pid)
        assert busy in workers and len(workers) == 2, (busy, workers)

        server.kill()
        killed_at = time.monotonic()
        # A liveness bound: they die with the server (the kernel signals them), so this only catches survivors.
        while any(_alive(p, t) for p, t in workers.items()) and time.monotonic() - killed_at < 30:
            time.sleep(0.02)
        took = time.monotonic() - killed_at
        survivors = [p for p, t in workers.items() if _alive(p, t)]
        assert not survivors, f"grader processes {survivors} outlived the server by {took:.1f}s"
    finally:
        for pid, started in workers.items():
            if _alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        grading.join(timeout=30)
