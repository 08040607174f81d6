"""The ``code`` grader's sandbox: runs a second and their p99 for a trivial solution, 2 at a time.

Three rows, side by side in one run, each for ``--seconds``:

- **a bare process**: ``python -I -c PROGRAM`` with the program and its asserts, no isolation and no limits: what
  one fresh interpreter per run costs on this machine (the floor under any per-run process);
- **the sandbox**: :func:`proctor.server.grading.sandbox.run_program`, called from 2 threads;
- **through /grade**: a real ``proctor serve`` of the shipped ``python_code`` curriculum with 2 grader processes,
  2 connections, each request one completion (a new one each time, so none is answered from a stored grade).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._http import Connection
from bench._load import Row, drive, row
from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.server.grading.sandbox import SandboxLimits, available_isolation, run_program
from proctor.server.shipped import builtin_path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2
SECONDS = 8.0
PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def _threads(run: Callable[[int], None], seconds: float) -> tuple[list[float], float]:
    """``run(n)`` on ``WORKERS`` threads for ``seconds``: each call's latency, and the seconds taken."""
    latencies: list[float] = []
    counter = itertools.count()
    started = time.perf_counter()
    deadline = started + seconds

    def loop() -> None:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            run(next(counter))
            latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=loop) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - started


def _bare(n: int) -> None:
    source = PROGRAM + "\n".join(TESTS) + f"\n# {n}\n"
    subprocess.run([sys.executable, "-I", "-c", source], check=True, stdout=subprocess.DEVNULL)


def _sandboxed(n: int) -> None:
    run = run_program(PROGRAM + f"# {n}\n", TESTS, SandboxLimits(), require=available_isolation())
    assert run.passed == len(TESTS), run


def _through_grade(seconds: float, folder: Path) -> Row:
    path = builtin_path("python_code")
    args = [str(path), "--database-url", str(folder / "state.db"), "--log-level", "warning"]
    with ServerProcess([*args, "--grader-workers", str(WORKERS)], log=folder / "server.log", cwd=ROOT) as server:

        async def measure() -> tuple[list[float], float]:
            first = await Connection.open("127.0.0.1", server.port)
            batch = await first.json("POST", "/sample", {"iteration": 0, "batch_size": 1})
            await first.close()
            sample_id = batch["samples"][0]["sample_id"]
            count = itertools.count()

            async def grade(c: Connection) -> None:
                # A record of the functions stage; its tests fail this program, which costs the sandbox the same.
                item = {"sample_id": sample_id, "completion": PROGRAM + f"# {next(count)}\n"}
                answer = await c.json("POST", "/grade", {"items": [item]})
                assert answer["results"][0]["error"] is None, answer

            return await drive(grade, seconds=seconds, concurrency=WORKERS, host="127.0.0.1", port=server.port)

        return row("through /grade (2 grader processes)", *asyncio.run(measure()))


def run(seconds: float = SECONDS) -> dict[str, Any]:
    results: dict[str, Any] = {
        "env": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "workers": WORKERS,
            "seconds": seconds,
            "isolation": available_isolation().name.lower(),
        }
    }
    bare = row("a bare process (python -I -c)", *_threads(_bare, seconds))
    sandbox = row("the sandbox (run_program)", *_threads(_sandboxed, seconds))
    with tempfile.TemporaryDirectory(prefix="proctor-bench-sandbox-") as tmp:
        graded = _through_grade(seconds, Path(tmp))
    results["rows"] = [asdict(r) for r in (bare, sandbox, graded)]
    return results


def table(results: dict[str, Any]) -> str:
    rows = [Row(**r) for r in results["rows"]]
    base = rows[0].per_second
    lines = [
        "| runs, 2 at a time | runs/s | p50 ms | p99 ms | ÷ a bare process |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = r.per_second / base
        lines.append(f"| {r.name} | {r.per_second:.1f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {ratio:.2f}× |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"per row (default {SECONDS:g})")
    args = parser.parse_args(argv)
    results = run(args.seconds)
    env = results["env"]
    print(
        f"code sandbox, trivial solution, {WORKERS} at a time, {env['cpus']} CPUs, Python {env['python']}, "
        f"isolation {env['isolation']}, {env['seconds']:g} s each"
    )
    print(table(results))
    save("sandbox", results)


if __name__ == "__main__":
    main()
