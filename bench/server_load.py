"""Load on a real dataserver process, driven from this (separate) process over loopback.

Measures, each with 8 concurrent connections:
- ``/sample`` (batch 16) of new iterations: stage decision, draw, SQLite commit (persistence on);
- ``/sample`` repeats of sampled iterations (what the other ranks and retries cost);
- ``/grade`` with 64 distinct completions per request, math-verify grading in the grader processes;
- ``/healthz`` probed one request at a time while ``/grade`` keeps the graders saturated, and idle.

Latencies are client-side, taken by a lean HTTP/1.1 client (``bench/_http.py``) that shares the machine with
the server.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import platform
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._http import Connection
from bench._results import save
from proctor.server.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 8
SAMPLE_BATCH = 16
GRADE_ITEMS = 64


@dataclass
class Row:
    name: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    target: str = ""

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _drive(
    call: Callable[[Connection], Awaitable[None]], *, seconds: float, concurrency: int, host: str, port: int
) -> tuple[list[float], float]:
    """``concurrency`` connections, each sending ``call`` back to back for ``seconds``."""
    conns = [await Connection.open(host, port) for _ in range(concurrency)]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(conn: Connection) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await call(conn)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - started
    for c in conns:
        await c.close()
    return latencies, elapsed


def _row(name: str, latencies: list[float], elapsed: float, target: str = "") -> Row:
    return Row(
        name, len(latencies), elapsed, _percentile(latencies, 0.5) * 1e3, _percentile(latencies, 0.99) * 1e3, target
    )


async def _run(host: str, port: int, seconds: float) -> list[Row]:
    rows: list[Row] = []
    drive = functools.partial(_drive, seconds=seconds, concurrency=CONCURRENCY, host=host, port=port)
    # Warm-up, away from the measured iterations. (Fresh connections per phase: uvicorn closes idle ones.)
    setup = await Connection.open(host, port)
    await setup.json("POST", "/sample", {"iteration": 10_000, "batch_size": SAMPLE_BATCH})
    await setup.close()

    iterations = itertools.count()
    samples: dict[int, list[dict[str, Any]]] = {}

    async def new_sample(c: Connection) -> None:
        i = next(iterations)
        samples[i] = (await c.json("POST", "/sample", {"iteration": i, "batch_size": SAMPLE_BATCH}))["samples"]

    rows.append(_row(f"/sample new iteration (batch {SAMPLE_BATCH})", *await drive(new_sample), "p99 ≤ 10 ms"))

    # What the other ranks (and retries) of recent steps ask for: a share of an iteration already sampled.
    recent = sorted(samples)[-64:]
    rng = random.Random(0)

    async def repeat_sample(c: Connection) -> None:
        body = {"iteration": rng.choice(recent), "batch_size": SAMPLE_BATCH, "rank": rng.randrange(4), "world_size": 4}
        await c.json("POST", "/sample", body)

    rows.append(_row("/sample repeat: a rank's share of a recent iteration", *await drive(repeat_sample)))

    counter = itertools.count()
    pool = [s for batch in samples.values() for s in batch]

    def grade_body() -> dict[str, Any]:
        n = next(counter)
        items = []
        for k in range(GRADE_ITEMS):
            s = pool[(n * GRADE_ITEMS + k) % len(pool)]
            # Distinct text per request, so the store never answers from its idempotency cache.
            answer = rng.choice(["42", "\\frac{3}{4}", "7", "x = 19", "66"])
            completion = f"<think>try {n}-{k}</think>{answer}"
            items.append({"sample_id": s["sample_id"], "completion": completion, "completion_index": k})
        return {"items": items}

    async def grade(c: Connection) -> None:
        await c.json("POST", "/grade", grade_body())

    rows.append(_row(f"/grade ({GRADE_ITEMS} completions, math-verify)", *await drive(grade)))

    # /healthz under grading load: 8 connections keep /grade busy while one more probes /healthz.
    stop = asyncio.Event()
    health: list[float] = []

    async def load(conn: Connection) -> None:
        while not stop.is_set():
            await grade(conn)

    async def probe() -> None:
        conn = await Connection.open(host, port)
        await asyncio.sleep(0.5)  # let the load build up
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await conn.json("GET", "/healthz")
            health.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
        stop.set()
        await conn.close()

    loaders = [await Connection.open(host, port) for _ in range(CONCURRENCY)]
    started = time.perf_counter()
    await asyncio.gather(probe(), *(load(c) for c in loaders))
    rows.append(_row("/healthz while /grade is saturated", health, time.perf_counter() - started, "p99 ≤ 20 ms"))
    for c in loaders:
        await c.close()

    idle: list[float] = []
    conn = await Connection.open(host, port)
    for _ in range(500):
        started = time.perf_counter()
        await conn.json("GET", "/healthz")
        idle.append(time.perf_counter() - started)
    await conn.close()
    rows.append(_row("/healthz idle", idle, sum(idle)))
    return rows


def run(seconds: float = 8.0) -> tuple[list[Row], dict[str, object]]:
    """Start a server on ``word_problems.yaml`` (math-verify graders) with state on disk and measure it."""
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            ["curricula/word_problems.yaml", "--state", str(Path(tmp) / "state.db"), "--log-level", "warning"],
            log=Path(tmp) / "server.log",
            cwd=ROOT,
        )
        with server:
            rows = asyncio.run(_run("127.0.0.1", server.port, seconds))
    env: dict[str, object] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "grader_workers": "one per core",
        "state": "SQLite file, WAL, synchronous=NORMAL",
    }
    return rows, env


def table(rows: list[Row]) -> str:
    lines = [
        "| endpoint | requests | req/s | p50 ms | p99 ms | target |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r.name} | {r.requests} | {r.per_second:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.target} |")
    return "\n".join(lines)


def main() -> None:
    rows, env = run()
    print(f"server load, {CONCURRENCY} concurrent connections, {env['cpus']} CPUs, Python {env['python']}")
    print(table(rows))
    save("server_load", {"env": env, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
