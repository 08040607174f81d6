"""Load on a real dataserver process, driven from this (separate) process over loopback, side by side with an
earlier version of the server (a git commit, run from a worktree of this repository) in the same run.

Measures, each with 8 concurrent connections, on a curriculum of 5,000 JSONL arithmetic rows graded by
``math`` alone:
- ``/sample`` (batch 16) of new iterations: stage decision, draw, SQLite commit (persistence on);
- ``/sample`` repeats of sampled iterations (what the other ranks and retries cost);
- ``/grade`` with 64 completions per request, every completion and every wrong final answer distinct from
  request to request (no cache can help), with plain-number answers and with LaTeX answers; and the
  server's efficiency on plain numbers: its completions/s over (grader processes × the math grader's bare
  single-process rate on the same completions, measured in this run);
- ``/healthz`` probed one request at a time while ``/grade`` keeps the graders saturated, and idle.

Latencies are client-side, taken by a lean HTTP/1.1 client (``bench/_http.py``) that shares the machine with
the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench import math_grader
from bench._baseline import BASELINE, available, checkout
from bench._http import Connection
from bench._load import GRADE_ITEMS, Row, completion, drive, row, write_curriculum
from bench._results import save
from bench.math_grader import Grader, time_grader
from proctor.cli.launcher import ServerProcess
from proctor.server.grading import builtin
from proctor.server.grading.base import GradeInput

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 8
SAMPLE_BATCH = 16
# Completions the bare rate is measured on (plain-number /grade items), and how many of them warm the grader up.
BARE_COMPLETIONS, BARE_WARM_UP = 40 * GRADE_ITEMS, 64


async def _run(
    host: str, port: int, seconds: float, answers: dict[str, str]
) -> tuple[list[Row], Row, list[GradeInput]]:
    """The rows; the plain-number /grade row among them; and plain-number /grade completions, not sent, for
    the bare rate of the math grader on the same kind of work."""
    rows: list[Row] = []
    timed = functools.partial(drive, seconds=seconds, concurrency=CONCURRENCY, host=host, port=port)
    # Warm-up, away from the measured iterations and within how far a new iteration may leap (100,000 by
    # default). (Fresh connections per phase: uvicorn closes idle ones.)
    setup = await Connection.open(host, port)
    await setup.json("POST", "/sample", {"iteration": 90_000, "batch_size": SAMPLE_BATCH})
    await setup.close()

    iterations = itertools.count()
    samples: dict[int, list[dict[str, Any]]] = {}

    async def new_sample(c: Connection) -> None:
        i = next(iterations)
        samples[i] = (await c.json("POST", "/sample", {"iteration": i, "batch_size": SAMPLE_BATCH}))["samples"]

    rows.append(
        row(f"/sample new iteration (batch {SAMPLE_BATCH})", *await timed(new_sample), "≥ 2,500 req/s, p99 ≤ 5 ms")
    )

    # What the other ranks (and retries) of recent steps ask for: a share of an iteration already sampled.
    recent = sorted(samples)[-64:]
    rng = random.Random(0)

    async def repeat_sample(c: Connection) -> None:
        body = {"iteration": rng.choice(recent), "batch_size": SAMPLE_BATCH, "rank": rng.randrange(4), "world_size": 4}
        await c.json("POST", "/sample", body)

    rows.append(row("/sample repeat: a rank's share of a recent iteration", *await timed(repeat_sample)))

    served = [s["sample_id"] for batch in samples.values() for s in batch]
    counter = itertools.count()

    def grade_items(n: int, latex: bool) -> list[dict[str, Any]]:
        items = []
        for k in range(GRADE_ITEMS):
            sid = served[(n * GRADE_ITEMS + k) % len(served)]
            text = completion(answers[sid], n, k, latex)
            items.append({"sample_id": sid, "completion": text, "completion_index": k})
        return items

    def grader(latex: bool) -> Callable[[Connection], Awaitable[None]]:
        async def grade(c: Connection) -> None:
            await c.json("POST", "/grade", {"items": grade_items(next(counter), latex)})

        return grade

    plain, latex = grader(latex=False), grader(latex=True)
    plain_row = row(
        f"/grade ({GRADE_ITEMS} completions, plain-number answers)", *await timed(plain), "≥ 500 req/s, p99 ≤ 100 ms"
    )
    rows.append(plain_row)
    rows.append(row(f"/grade ({GRADE_ITEMS} completions, LaTeX answers)", *await timed(latex)))

    # /healthz under grading load: 8 connections keep /grade busy while a process of its own probes /healthz
    # (bench/_probe.py: a probe in this process would wait for this loop's own work as well as the server's).
    stop = asyncio.Event()

    async def load(conn: Connection) -> None:
        while not stop.is_set():
            await plain(conn)

    async def probe() -> list[float]:
        try:
            await asyncio.sleep(0.5)  # let the load build up
            prober = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench._probe", str(port), str(seconds), cwd=ROOT, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await prober.communicate()
        finally:
            stop.set()  # a probe that failed ends the load too, rather than leave it running
        return [float(s) for s in json.loads(out)]

    loaders = [await Connection.open(host, port) for _ in range(CONCURRENCY)]
    started = time.perf_counter()
    probing = asyncio.create_task(probe())
    await asyncio.gather(*(load(c) for c in loaders))
    health = await probing
    rows.append(row("/healthz while /grade is saturated", health, time.perf_counter() - started, "p99 ≤ 20 ms"))
    for c in loaders:
        await c.close()

    idle: list[float] = []
    conn = await Connection.open(host, port)
    for _ in range(500):
        started = time.perf_counter()
        await conn.json("GET", "/healthz")
        idle.append(time.perf_counter() - started)
    await conn.close()
    rows.append(row("/healthz idle", idle, sum(idle)))
    bare = [
        GradeInput(prompt="", completion=it["completion"], answer=answers[it["sample_id"]])
        for n in range(BARE_COMPLETIONS // GRADE_ITEMS)
        for it in grade_items(10**6 + n, False)
    ]
    return rows, plain_row, bare


def _measure(seconds: float, env: dict[str, str] | None, module: str, grader: Grader) -> tuple[list[Row], float, float]:
    """Rows, completions/s of the plain-number /grade row, and the bare rate of ``grader`` (the version's own
    ``math``): completions/s in this one process on completions like that row's, once the server has stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        curriculum, records = write_curriculum(Path(tmp))
        # The baseline commit (env set) names the run's database --state.
        database = "--database-url" if env is None else "--state"
        server = ServerProcess(
            [str(curriculum), database, str(Path(tmp) / "state.db"), "--log-level", "warning"],
            log=Path(tmp) / "server.log",
            cwd=ROOT,
            env=env,
            module=module,
        )
        with server:
            meta = httpx.get(server.url + "/meta", timeout=10).json()
            [source] = meta["sources"]
            # Sample ids are source:version:key, the key being the row's index.
            prefix = f"{source['name']}:{source['version']}:"
            answers = {f"{prefix}{k}": r["answer"] for k, r in enumerate(records)}
            rows, plain, bare = asyncio.run(_run("127.0.0.1", server.port, seconds, answers))
    # Untimed first: the baseline grader imports math_verify and sympy on its first call.
    time_grader(grader, bare[:BARE_WARM_UP], math_grader.SECONDS)
    verdicts, elapsed = time_grader(grader, bare, math_grader.SECONDS)
    return rows, plain.per_second * GRADE_ITEMS, len(verdicts) / elapsed


def run(seconds: float = 8.0, baseline: str | None = BASELINE) -> dict[str, Any]:
    """This checkout's server, then ``baseline``'s, measured alike one after the other."""
    workers = os.cpu_count() or 1
    results: dict[str, Any] = {
        "env": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "grader_workers": workers,
            "state": "SQLite file, WAL, synchronous=NORMAL",
            "baseline": baseline,
        }
    }
    # Each version's math grader is timed in this process: the baseline's is its builtin.py read from git, whose
    # math needs only math_verify and grading.base (unchanged since), so it runs here as in its own checkout.
    now = functools.partial(builtin.math, timeout_s=math_grader.TIMEOUT_S)
    versions: list[tuple[str, dict[str, str] | None, str, Grader]] = [("now", None, "proctor.cli", now)]
    with contextlib.ExitStack() as stack:
        if baseline is not None:
            env, module = stack.enter_context(checkout(baseline))
            before, _ = math_grader.graders(baseline)
            versions.append(("before", env, module, before))
        for label, env_, module_, grader in versions:
            rows, completions, bare = _measure(seconds, env_, module_, grader)
            results[label] = {
                "rows": [asdict(r) for r in rows],
                "grade_completions_per_s": completions,
                "bare_math_per_s": bare,
                "efficiency": completions / (workers * bare),
            }
    return results


def table(results: dict[str, Any]) -> str:
    now, before = results["now"], results.get("before")
    head = "| endpoint | requests | req/s | p50 ms | p99 ms |"
    rule = "| --- | ---: | ---: | ---: | ---: |"
    if before:
        head += " before: req/s | before: p99 ms |"
        rule += " ---: | ---: |"
    lines = [head + " goal |", rule + " --- |"]
    for n, r in enumerate(now["rows"]):
        rate = r["requests"] / r["seconds"]
        line = f"| {r['name']} | {r['requests']} | {rate:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
        if before:
            b = before["rows"][n]
            line += f" {b['requests'] / b['seconds']:.0f} | {b['p99_ms']:.1f} |"
        lines.append(line + f" {r['goal']} |")
    lines.append("")
    lines.append("| /grade, plain-number answers | now | before |")
    lines.append("| --- | ---: | ---: |")
    for key, label, fmt in [
        ("grade_completions_per_s", "completions/s through the server", "{:.0f}"),
        ("bare_math_per_s", "math grader alone, one process (completions/s)", "{:.0f}"),
        ("efficiency", f"efficiency: server ÷ ({results['env']['grader_workers']} processes × bare rate)", "{:.2f}"),
    ]:
        lines.append(f"| {label} | {fmt.format(now[key])} | {fmt.format(before[key]) if before else '-'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench server_load", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-baseline", action="store_true", help=f"measure this version alone, not commit {BASELINE} after it"
    )
    args = parser.parse_args(argv)
    baseline = None if args.no_baseline else BASELINE
    if baseline is not None and not available(baseline):
        print(f"commit {BASELINE} is not in this clone (a shallow one?): measuring this version alone")
        baseline = None
    results = run(baseline=baseline)
    env = results["env"]
    print(f"server load, {CONCURRENCY} concurrent connections, {env['cpus']} CPUs, Python {env['python']}")
    if baseline:
        print(f"before: commit {baseline}, measured right after, the same way")
    print(table(results))
    save("server_load", results)


if __name__ == "__main__":
    main()
