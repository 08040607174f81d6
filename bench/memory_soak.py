"""Server memory over a long run of new iterations: does RSS stay flat?

A real dataserver process (``curricula/arithmetic.yaml``, procedural, so every sample id is new; state in a
SQLite file; one grader process) is driven over loopback by ``CONNECTIONS`` lean HTTP/1.1 connections
(``bench/_http.py``) through iterations ``0..N-1``: ``POST /sample`` of each new iteration at batch size
``B`` and, for every ``GRADE_EVERY``-th iteration, ``POST /grade`` of one cheap completion (``"7"``,
``completion_index`` 0) for each of its prompts. The server's resident set (``VmRSS`` of its process) and the
summed resident set of its descendants (the grader processes) are read from ``/proc`` at fixed iteration
marks; the table ends with the growth from the 10% mark to the end, so that start-up and warm-up (caches
filling, the allocator's first arenas) do not count.

Usage::

    python -m bench memory_soak                       # the long run: 100_000 iterations × 512 prompts
    python -m bench memory_soak --quick               # 5_000 × 64, about 30 s
    python -m bench memory_soak --iterations 20000 --batch-size 16
    python -m bench                                   # every benchmark; this one at ALL_BENCHMARKS_ARGS

Sizes: on a 2-core machine, 10_000 × 512 soaked in 283 s at a steady 35 iterations/s, so
the full run (100_000 × 512) takes about 47 minutes and leaves a state file of roughly 17 GB in the temp
directory (about 170 KB per iteration). That is too long for ``python -m bench`` (every benchmark in a row),
which runs this one at ``ALL_BENCHMARKS_ARGS`` instead: a tenth of it, 10_000 iterations of 512
prompts (about 5 minutes; every cache the server keeps is full well before the 10% mark).
``python -m bench memory_soak`` runs the full size.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._http import Connection
from bench._results import save
from proctor.cli.launcher import ServerProcess

__all__ = ["ALL_BENCHMARKS_ARGS", "Mark", "Soak", "growth", "main", "read_rss_kib", "run", "table"]

ROOT = Path(__file__).resolve().parents[1]
CONNECTIONS = 4
ITERATIONS, BATCH_SIZE = 100_000, 512  # a long training run's worth of steps at a realistic batch
QUICK_ITERATIONS, QUICK_BATCH_SIZE = 5_000, 64
GRADE_EVERY = 4  # every 4th iteration is graded, one completion per prompt
MARKS = 20  # RSS readings over the run, besides the one before it
WARM_UP = 0.10  # growth is measured from this fraction of the run to its end
# What `python -m bench` (every benchmark in a row) runs; `python -m bench memory_soak` runs the full size.
ALL_BENCHMARKS_ARGS = ["--iterations", "10000", "--batch-size", "512"]


@dataclass
class Mark:
    iterations: int  # iterations answered when RSS was read
    server_mib: float
    graders_mib: float  # summed over every descendant of the server process
    seconds: float  # since the first iteration was sent


@dataclass
class Soak:
    iterations: int
    batch_size: int
    grade_every: int
    connections: int
    marks: list[Mark]


def read_rss_kib(pid: int) -> int:
    """``VmRSS`` of a process, in KiB (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the grader workers, started with ``subprocess``, are its children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) is parenthesised and may hold spaces; the parent pid follows it.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _mark(pid: int, iterations: int, started: float) -> Mark:
    graders = sum(read_rss_kib(p) for p in _descendants(pid))
    return Mark(iterations, read_rss_kib(pid) / 1024, graders / 1024, time.perf_counter() - started)


async def _soak(
    host: str, port: int, pid: int, *, iterations: int, batch_size: int, grade_every: int, connections: int
) -> list[Mark]:
    conns = [await Connection.open(host, port) for _ in range(connections)]
    every = max(1, iterations // MARKS)
    started = time.perf_counter()
    marks = [_mark(pid, 0, started)]
    todo = itertools.count()
    done = 0

    async def worker(conn: Connection) -> None:
        nonlocal done
        while (i := next(todo)) < iterations:
            status, body = await conn.request("POST", "/sample", {"iteration": i, "batch_size": batch_size})
            if status != 200:
                raise RuntimeError(f"/sample {i} -> {status}: {body[:300]!r}")
            if i % grade_every == 0:
                samples = json.loads(body)["samples"]
                items = [{"sample_id": s["sample_id"], "completion": "7", "completion_index": 0} for s in samples]
                await conn.json("POST", "/grade", {"iteration": i, "items": items})
            done += 1
            if done % every == 0 or done == iterations:
                marks.append(_mark(pid, done, started))

    await asyncio.gather(*(worker(c) for c in conns))
    for c in conns:
        await c.close()
    return marks


def run(
    iterations: int = ITERATIONS,
    batch_size: int = BATCH_SIZE,
    *,
    grade_every: int = GRADE_EVERY,
    connections: int = CONNECTIONS,
) -> tuple[Soak, dict[str, object]]:
    """Start a server on ``arithmetic.yaml`` with state on disk and one grader process, and soak it."""
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            [
                "curricula/arithmetic.yaml",
                "--database-url",
                str(Path(tmp) / "state.db"),
                "--grader-workers",
                "1",
                "--log-level",
                "warning",
            ],
            log=Path(tmp) / "server.log",
            cwd=ROOT,
        )
        with server:
            marks = asyncio.run(
                _soak(
                    "127.0.0.1",
                    server.port,
                    server.pid,
                    iterations=iterations,
                    batch_size=batch_size,
                    grade_every=grade_every,
                    connections=connections,
                )
            )
    env: dict[str, object] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "grader_workers": 1,
        "state": "SQLite file, WAL, synchronous=NORMAL",
        "curriculum": "curricula/arithmetic.yaml",
    }
    return Soak(iterations, batch_size, grade_every, connections, marks), env


def growth(marks: Sequence[Mark], warm_up: float = WARM_UP) -> tuple[Mark, Mark, float]:
    """The mark at ``warm_up`` of the run, the last one, and the server's growth between them in KiB per
    1000 iterations."""
    last = marks[-1]
    start = next(m for m in marks if m.iterations >= warm_up * last.iterations)
    span = last.iterations - start.iterations
    rate = (last.server_mib - start.server_mib) * 1024 * 1000 / span if span else 0.0
    return start, last, rate


def table(soak: Soak) -> str:
    lines = [
        "| iterations | server RSS MiB | grader RSS MiB | elapsed s |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for m in soak.marks:
        lines.append(f"| {m.iterations} | {m.server_mib:.1f} | {m.graders_mib:.1f} | {m.seconds:.0f} |")
    start, last, rate = growth(soak.marks)
    lines.append("")
    lines.append(
        f"server growth from iteration {start.iterations} to {last.iterations}: "
        f"{last.server_mib - start.server_mib:+.1f} MiB ({rate:+.1f} KiB per 1000 iterations); "
        f"graders {last.graders_mib - start.graders_mib:+.1f} MiB"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench memory_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ITERATIONS} iterations of {QUICK_BATCH_SIZE} prompts"
    )
    parser.add_argument("--iterations", type=int, help=f"new iterations to sample (default {ITERATIONS})")
    parser.add_argument("--batch-size", type=int, help=f"prompts per iteration (default {BATCH_SIZE})")
    parser.add_argument("--grade-every", type=int, default=GRADE_EVERY, help="grade every k-th iteration")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="concurrent connections")
    args = parser.parse_args(argv)
    iterations = args.iterations or (QUICK_ITERATIONS if args.quick else ITERATIONS)
    batch_size = args.batch_size or (QUICK_BATCH_SIZE if args.quick else BATCH_SIZE)
    soak, env = run(iterations, batch_size, grade_every=args.grade_every, connections=args.connections)
    print(
        f"memory soak: {iterations} new iterations × {batch_size} prompts, every {args.grade_every}th graded, "
        f"{args.connections} connections, {env['cpus']} CPUs, Python {env['python']}"
    )
    print(table(soak))
    start, last, rate = growth(soak.marks)
    payload: dict[str, Any] = {
        "env": env,
        **{k: v for k, v in asdict(soak).items() if k != "marks"},
        "marks": [asdict(m) for m in soak.marks],
        "growth": {
            "from_iteration": start.iterations,
            "to_iteration": last.iterations,
            "server_mib": last.server_mib - start.server_mib,
            "server_kib_per_1000_iterations": rate,
            "graders_mib": last.graders_mib - start.graders_mib,
        },
    }
    save("memory_soak", payload)


if __name__ == "__main__":
    main()
