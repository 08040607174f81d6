"""Load on a real dataserver process, driven from this (separate) process over loopback.

Measures, each with 8 concurrent connections:
- ``/sample`` (batch 16) of new iterations: stage decision, draw, SQLite commit (persistence on);
- ``/sample`` repeats of sampled iterations (what the other ranks and retries cost);
- ``/grade`` with 64 distinct completions per request, math-verify grading in the grader processes;
- ``/healthz`` probed one request at a time while ``/grade`` keeps the graders saturated, and idle.

Latencies are client-side (they include this client's own overhead on the same machine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

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
    call: Callable[[httpx.AsyncClient], Awaitable[None]], *, seconds: float, concurrency: int, client: httpx.AsyncClient
) -> tuple[list[float], float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await call(client)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def _row(name: str, latencies: list[float], elapsed: float, target: str = "") -> Row:
    return Row(
        name, len(latencies), elapsed, _percentile(latencies, 0.5) * 1e3, _percentile(latencies, 0.99) * 1e3, target
    )


async def _run(url: str, seconds: float) -> list[Row]:
    limits = httpx.Limits(max_connections=CONCURRENCY + 1, max_keepalive_connections=CONCURRENCY + 1)
    rows: list[Row] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        # Warm-up: first requests import lazily loaded parts (math-verify in each grader process).
        await client.post("/sample", json={"iteration": 10_000, "batch_size": SAMPLE_BATCH})

        iterations = itertools.count()
        samples: dict[int, list[dict[str, object]]] = {}

        async def new_sample(c: httpx.AsyncClient) -> None:
            i = next(iterations)
            r = await c.post("/sample", json={"iteration": i, "batch_size": SAMPLE_BATCH})
            r.raise_for_status()
            samples[i] = r.json()["samples"]

        lat, elapsed = await _drive(new_sample, seconds=seconds, concurrency=CONCURRENCY, client=client)
        rows.append(_row(f"/sample new iteration (batch {SAMPLE_BATCH})", lat, elapsed, "p99 ≤ 10 ms"))

        sampled = list(samples)
        rng = random.Random(0)

        async def repeat_sample(c: httpx.AsyncClient) -> None:
            i = rng.choice(sampled)
            r = await c.post(
                "/sample", json={"iteration": i, "batch_size": SAMPLE_BATCH, "rank": rng.randrange(4), "world_size": 4}
            )
            r.raise_for_status()

        lat, elapsed = await _drive(repeat_sample, seconds=seconds, concurrency=CONCURRENCY, client=client)
        rows.append(_row("/sample repeat, a rank's share", lat, elapsed))

        counter = itertools.count()
        pool = [s for batch in samples.values() for s in batch]

        def grade_body() -> dict[str, object]:
            n = next(counter)
            items = []
            for k in range(GRADE_ITEMS):
                s = pool[(n * GRADE_ITEMS + k) % len(pool)]
                # Distinct text per request, so the store never answers from its idempotency cache.
                answer = rng.choice(["42", "\\frac{3}{4}", "7", "x = 19", "66"])
                completion = f"<think>try {n}-{k}</think>{answer}"
                items.append({"sample_id": s["sample_id"], "completion": completion, "completion_index": k})
            return {"items": items}

        async def grade(c: httpx.AsyncClient) -> None:
            r = await c.post("/grade", json=grade_body())
            r.raise_for_status()

        lat, elapsed = await _drive(grade, seconds=seconds, concurrency=CONCURRENCY, client=client)
        grade_row = _row(f"/grade ({GRADE_ITEMS} completions, math-verify)", lat, elapsed)
        rows.append(grade_row)

        # /healthz under grading load: 8 connections keep /grade busy while one probe measures /healthz.
        stop = asyncio.Event()
        health: list[float] = []

        async def load() -> None:
            async def one() -> None:
                while not stop.is_set():
                    await grade(client)

            await asyncio.gather(*(one() for _ in range(CONCURRENCY)))

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=10) as p:
                await asyncio.sleep(0.5)  # let the load build up
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    started = time.perf_counter()
                    (await p.get("/healthz")).raise_for_status()
                    health.append(time.perf_counter() - started)
                    await asyncio.sleep(0.01)
            stop.set()

        started = time.perf_counter()
        await asyncio.gather(load(), probe())
        rows.append(_row("/healthz while /grade is saturated", health, time.perf_counter() - started, "p99 ≤ 20 ms"))

        idle: list[float] = []
        for _ in range(300):
            started = time.perf_counter()
            (await client.get("/healthz")).raise_for_status()
            idle.append(time.perf_counter() - started)
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
            rows = asyncio.run(_run(server.url, seconds))
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
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "server_load.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
