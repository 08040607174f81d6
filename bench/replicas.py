"""Servers of one PostgreSQL database behind a load balancer, side by side in one run: what forwarding costs, and
what a ``kill -9`` of the serving process costs.

Throughput: the rollout path's ``/sample`` and ``/grade`` loads (``bench.rollout_path``, 8 connections) against
one server directly, against that server through nginx (``bench/_balancer.py``), against two servers of the
database through nginx (one serves; the other grades the ``/grade`` requests it gets, the serving one storing
them, and forwards the rest), and against ``proctor serve --workers 2`` (two such processes on one port, asked
directly). Then a bound for servers that share one run's work: two servers that share nothing (each its own
database on the same PostgreSQL), each asked directly on half the connections, at the same time.

Failover: three servers behind nginx and 8 connections asking for new iterations (a write each) without
retrying; after a while the serving process is killed with SIGKILL. Counted: the requests that failed, and the
time from the kill to the last failure (after which every request succeeded again).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench._balancer import balancer
from bench._http import Connection
from bench._load import Row, write_curriculum
from bench._postgresql import cluster
from bench._results import save
from bench.rollout_path import CONCURRENCY, measure
from proctor.cli.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 8.0
FAILOVER_SECONDS = 10.0
GOALS: dict[str, float | None] = {"sample": None, "grade": 1.3}  # --workers 2 ÷ 1 server (None: report)


async def failover(url: str, kill: Callable[[], None], seconds: float) -> dict[str, float]:
    """New iterations on ``CONCURRENCY`` connections for ``seconds``, ``kill()`` after a third of them."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    iterations = itertools.count()
    outcomes: list[tuple[float, bool]] = []
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        conn = await Connection.open(host, port)
        while time.perf_counter() < deadline:
            try:
                status, _ = await conn.request("POST", "/sample", {"iteration": next(iterations), "batch_size": 16})
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                status = 0
                await conn.close()
                conn = await Connection.open(host, port)
            outcomes.append((time.perf_counter(), status == 200))
        await conn.close()

    async def killer() -> float:
        await asyncio.sleep(seconds / 3)
        kill()
        return time.perf_counter()

    kill_at = asyncio.create_task(killer())
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    killed = await kill_at
    failed = [t for t, ok in outcomes if not ok]
    return {
        "requests": len(outcomes),
        "failed": len(failed),
        "to_full_service_s": (max(failed) - killed) if failed else 0.0,
        "served_before_kill": sum(ok and t < killed for t, ok in outcomes),
    }


def run(seconds: float = SECONDS, failover_seconds: float = FAILOVER_SECONDS) -> dict[str, Any]:
    results: dict[str, Any] = {
        "env": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}
    }
    keep = {"PROCTOR_EXPERIENCE_KEEP_ITERATIONS": "1000000"}
    with tempfile.TemporaryDirectory(prefix="proctor-replicas-") as tmp, cluster() as pg:
        folder = Path(tmp)
        curriculum, records = write_curriculum(folder)

        def answer_of(sample_id: str) -> str:
            return records[int(sample_id.rsplit(":", 1)[1])]["answer"]

        def servers(database: str, count: int, name: str, *extra: str) -> list[ServerProcess]:
            args = [str(curriculum), "--database-url", database, "--log-level", "warning", *extra]
            return [
                ServerProcess(args, log=folder / f"{name}-{n}.log", cwd=ROOT, env=keep).start() for n in range(count)
            ]

        def stop(procs: Sequence[ServerProcess]) -> None:
            for p in procs:
                p.stop()

        one = servers(pg.new_database(), 1, "direct")
        try:
            results["direct"] = {k: asdict(v) for k, v in asyncio.run(measure(one[0].port, seconds, answer_of)).items()}
        finally:
            stop(one)
        processes = servers(pg.new_database(), 1, "workers_2", "--workers", "2")
        try:
            until_both_answer(processes[0].url)
            results["workers_2"] = {
                k: asdict(v) for k, v in asyncio.run(measure(processes[0].port, seconds, answer_of)).items()
            }
        finally:
            stop(processes)
        for count, key in ((1, "balanced_1"), (2, "balanced_2")):
            procs = servers(pg.new_database(), count, key)
            try:
                with balancer([f"127.0.0.1:{p.port}" for p in procs]) as url:
                    port = urlsplit(url).port or 80
                    results[key] = {k: asdict(v) for k, v in asyncio.run(measure(port, seconds, answer_of)).items()}
            finally:
                stop(procs)
        apart = [*servers(pg.new_database(), 1, "apart-a"), *servers(pg.new_database(), 1, "apart-b")]
        try:

            async def side_by_side() -> list[dict[str, Row]]:
                half = CONCURRENCY // 2
                loads = (measure(p.port, seconds, answer_of, concurrency=half) for p in apart)
                return list(await asyncio.gather(*loads))

            results["apart_2"] = [{k: asdict(v) for k, v in r.items()} for r in asyncio.run(side_by_side())]
        finally:
            stop(apart)
        procs = servers(pg.new_database(), 3, "failover")
        try:
            with balancer([f"127.0.0.1:{p.port}" for p in procs]) as url:
                results["failover"] = asyncio.run(failover(url, procs[0].kill, failover_seconds))
        finally:
            stop(procs)
    return results


def until_both_answer(url: str) -> None:
    """Until new connections to the port have reached both processes (the serving one and the standby), and the
    standby has had a moment to start its grader processes."""
    deadline = time.monotonic() + 60
    seen: set[str] = set()
    while len(seen) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the two processes of --workers 2 did not both answer at {url}")
        text = httpx.get(url + "/metrics", headers={"connection": "close"}, timeout=30).text
        seen |= {x for x in text.splitlines() if x.startswith("proctor_serving ")}
    time.sleep(3.0)


def table(results: dict[str, Any]) -> str:
    lines = [
        "| endpoint | 1 server req/s | 1 server p99 ms | 1 behind nginx req/s | 2 behind nginx req/s | "
        "2 behind nginx ÷ 1 | --workers 2 req/s | --workers 2 p99 ms | --workers 2 ÷ 1 | goal | "
        "2 sharing nothing req/s | sharing nothing ÷ 1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for key in ("sample", "grade"):
        a, b, c, w = (Row(**results[side][key]) for side in ("direct", "balanced_1", "balanced_2", "workers_2"))
        apart = sum(Row(**r[key]).per_second for r in results["apart_2"])
        ratio = w.per_second / a.per_second
        least = GOALS[key]
        goal = "report" if least is None else f"≥ {least:g}×" + (" ✗" if ratio < least else "")
        lines.append(
            f"| {a.name} | {a.per_second:.0f} | {a.p99_ms:.1f} | {b.per_second:.0f} | {c.per_second:.0f} | "
            f"{c.per_second / a.per_second:.2f}× | {w.per_second:.0f} | {w.p99_ms:.1f} | "
            f"{ratio:.2f}× | {goal} | {apart:.0f} | {apart / a.per_second:.2f}× |"
        )
    f = results["failover"]
    lines += [
        "",
        "| failover (3 servers behind nginx, SIGKILL of the serving one) | value |",
        "| --- | ---: |",
        f"| requests (new iterations, {CONCURRENCY} connections, no retries) | {f['requests']} |",
        f"| of them failed | {f['failed']} |",
        f"| seconds from the kill to the last failure | {f['to_full_service_s']:.2f} |",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"per measurement (default {SECONDS:g})")
    args = parser.parse_args(argv)
    results = run(args.seconds)
    env = results["env"]
    print(f"servers of one PostgreSQL database, {CONCURRENCY} connections, {env['cpus']} CPUs, Python {env['python']}")
    print(table(results))
    save("replicas", results)


if __name__ == "__main__":
    main()
