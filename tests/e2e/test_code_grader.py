"""The ``code`` grader through a real ``proctor serve`` of the shipped ``python_code`` curriculum: hostile programs
get clean verdicts from ``/grade``, the server keeps answering ``/healthz`` meanwhile, and the verdicts are kept
with the grades (a retry is answered from them)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import ServerProcess
from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grading.sandbox import Isolation, available_isolation
from proctor.server.shipped import builtin_path
from proctor.server.sources.base import SampleId

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(available_isolation() < Isolation.NAMESPACES, reason="the sandbox's namespaces need root"),
]

# Each bounded on its own: a loop that ends, a count of forks, a finite output.
HOSTILE = {
    "loop": "import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass",
    "forks": "import os, time\nfor _ in range(300):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
    "    if pid == 0:\n        time.sleep(20)\n        os._exit(0)",
    "memory": "x = bytearray(10 * 1024**3)",
    "escape": "open('/tmp/proctor-e2e-escape', 'w').write('x')",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)",
    "environ": "import os\nprint(open('/proc/%d/environ' % os.getppid()).read())",
    "kill": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "output": "import os\nfor _ in range(16384):\n    os.write(1, b'x' * 65536)",
    "segfault": "import ctypes\nctypes.string_at(0)",
}
EXPECTED = {
    "loop": {"timeout"},
    "forks": {"error", "fail"},  # the program defines nothing the tests call
    "memory": {"memory"},
    "escape": {"error"},
    "socket": {"error"},
    "environ": {"error"},
    "kill": {"error"},
    "output": {"output"},
    "segfault": {"crash"},
}


def test_hostile_programs_get_clean_verdicts_and_the_server_stays_up(
    server_process: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    path = builtin_path("python_code")
    server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "2"])
    curriculum = load_curriculum(path)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        batch = client.post("/sample", json={"iteration": 0, "batch_size": 3}).json()["samples"]
        items: list[dict[str, Any]] = []
        names = list(HOSTILE)
        for slot, sample in enumerate(batch):
            sid = SampleId.parse(sample["sample_id"])
            reference = curriculum.sources[sid.source].record(sid.key).answer
            assert reference is not None
            items.append(
                {
                    "sample_id": sample["sample_id"],
                    "slot": slot,
                    "completion_index": 0,
                    "completion": f"```python\n{reference}```",
                }
            )
            for k in range(3):
                items.append(
                    {
                        "sample_id": sample["sample_id"],
                        "slot": slot,
                        "completion_index": k + 1,
                        "completion": HOSTILE[names[slot * 3 + k]],
                    }
                )

        probes: list[int] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=5) as c:
                while not done.is_set():
                    probes.append(c.get("/healthz").status_code)  # a timeout here fails the test
                    time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            answer = client.post("/grade", json={"iteration": 0, "items": items})
        finally:
            done.set()
            prober.join()
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert probes and set(probes) == {200}
        for item, result in zip(items, results, strict=True):
            verdict = result["details"]["code"]
            assert result["error"] is None  # a program's failure is its verdict, never a grader error
            if item["completion_index"] == 0:
                assert result["reward"] == 1.0
                assert set(verdict["tests"]) == {"pass"}
            else:
                name = names[item["slot"] * 3 + item["completion_index"] - 1]
                assert result["reward"] == 0.0, name
                assert set(verdict["tests"]) <= EXPECTED[name], (name, verdict)
        assert not os.path.exists("/tmp/proctor-e2e-escape")

        again = client.post("/grade", json={"iteration": 0, "items": items}).json()["results"]
        assert [r["cached"] for r in again] == [True] * len(items)
        assert [r["details"] for r in again] == [r["details"] for r in results]
        assert client.get("/healthz").status_code == 200


def test_a_grade_worker_runs_the_sandboxes_and_its_verdicts_are_kept(
    server_process: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    # The grader role on a `proctor grade-worker`: its verdicts reach the server as the rows' reward_detail cells.
    path = builtin_path("python_code")
    server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "0"])
    curriculum = load_curriculum(path)
    cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", server.url, "--workers", "1"]
    with (tmp_path / "worker.log").open("ab") as log:
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            [sample] = client.post("/sample", json={"iteration": 0, "batch_size": 1}).json()["samples"]
            sid = SampleId.parse(sample["sample_id"])
            reference = curriculum.sources[sid.source].record(sid.key).answer
            items = [
                {"sample_id": sample["sample_id"], "completion_index": 0, "completion": f"```python\n{reference}```"},
                {"sample_id": sample["sample_id"], "completion_index": 1, "completion": HOSTILE["segfault"]},
            ]
            answer = client.post("/grade", json={"iteration": 0, "items": items})
            assert answer.status_code == 200, answer.text
            right, crashed = answer.json()["results"]
            assert right["reward"] == 1.0 and set(right["details"]["code"]["tests"]) == {"pass"}
            assert crashed["reward"] == 0.0 and crashed["details"]["code"]["failure"] == "crash"
            again = client.post("/grade", json={"iteration": 0, "items": items}).json()["results"]
            assert [r["details"] for r in again] == [right["details"], crashed["details"]]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
