"""What the load benchmarks share: a curriculum of arithmetic rows, the completions sent for them, and a driver
that keeps N connections busy for a while and keeps each request's latency."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench._http import Connection

__all__ = [
    "GRADE_ITEMS",
    "ROWS",
    "Row",
    "completion",
    "dispatch_requests",
    "drive",
    "percentile",
    "process_cpu_s",
    "row",
    "write_curriculum",
]

GRADE_ITEMS = 64
ROWS = 5_000


@dataclass
class Row:
    name: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    goal: str = ""
    cpu_ms: float | None = None
    """The server process's CPU time (all its threads) per request, where the benchmark reads it."""

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system, all threads) a process has used so far, from ``/proc`` (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        after_name = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def drive(
    fn: Callable[[Connection], Awaitable[None]], *, seconds: float, concurrency: int, host: str, port: int
) -> tuple[list[float], float]:
    """``fn`` on ``concurrency`` connections, each calling it again as soon as it returns, for ``seconds``: the
    latency of every call, and the seconds taken."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(conn: Connection) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await fn(conn)
            latencies.append(time.perf_counter() - started)

    conns = [await Connection.open(host, port) for _ in range(concurrency)]
    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - started
    for c in conns:
        await c.close()
    return latencies, elapsed


def row(name: str, latencies: list[float], elapsed: float, goal: str = "") -> Row:
    ms = [x * 1000 for x in latencies]
    return Row(name, len(latencies), elapsed, percentile(ms, 0.5), percentile(ms, 0.99), goal)


def write_curriculum(folder: Path) -> tuple[Path, list[dict[str, str]]]:
    """5,000 arithmetic rows in a JSONL file (``rows.jsonl``) and a one-stage curriculum over them, graded by
    ``math``: the curriculum's path and the rows, in file order."""
    rng = random.Random(7)
    rows = []
    for _ in range(ROWS):
        a, b, c = rng.randrange(1, 2000), rng.randrange(1, 50), rng.randrange(1, 50)
        rows.append({"question": f"What is {a} + {b} × {c}?", "answer": str(a + b * c)})
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / "load.yaml"
    path.write_text(
        "name: load\nseed: 1\n"
        "sources:\n  rows:\n    path: rows.jsonl\n    prompt_field: question\n    answer_field: answer\n"
        "    graders: [{name: math}]\n"
        "stages:\n  - {name: only, until_step: 100000000, mix: [{source: rows}]}\n"
    )
    return path, rows


def completion(answer: str, n: int, k: int, latex: bool) -> str:
    """The k-th completion of request n: every fourth right, the others wrong, each final answer distinct.
    LaTeX answers are expressions (not plain numbers), so that math-verify parses every one of them."""
    value = int(answer) if k % 4 == 0 else int(answer) + 1 + n * GRADE_ITEMS + k
    final = f"\\boxed{{\\frac{{{4 * value}}}{{2}} - {value}}}" if latex else str(value)
    return f"<think>working {n}-{k}</think>{final}"


def dispatch_requests(url: str) -> int:
    """Dispatches the server at ``url`` has answered (a grade-worker's first one says it is up)."""
    routes = tuple(
        f'proctor_requests_total{{method="POST",route="/experience/consumers/{{name}}/{route}"'
        for route in ("dispatch", "dispatches")
    )
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines if line.startswith(routes))
