"""The rollout path against its bare baseline, side by side in one run: ``/sample`` and ``/grade`` of a real
``proctor serve`` process and of ``bench.bare_baseline`` (a minimal FastAPI app that keeps nothing), on the same
rows, the same workload and the same machine.

Workload, 8 connections each: ``/sample`` of new iterations, 16 prompts each; then ``/grade`` of one sampled
step a request, 4 completions of each of its 16 prompts (64), each a short reasoning then a final number,
every answer distinct across requests (no cache can help), graded by the ``math`` grader on both. proctor
opens each step's table in its experience store, writes every completion and reward there and every batch
and grade to its state (SQLite, WAL), and grades in its grader processes (one per core); the baseline grades
in its one process and keeps nothing. Then the same two loads on a server whose state is a PostgreSQL database
(a local cluster started for the run, ``bench/_postgresql.py``), and the ``/grade`` load with the grader role in
two ``proctor grade-worker`` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._http import Connection
from bench._load import (
    GRADE_ITEMS,
    Row,
    completion,
    dispatch_requests,
    drive,
    process_cpu_s,
    row,
    write_curriculum,
)
from bench._postgresql import cluster
from bench._results import save
from proctor.cli.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 8
SAMPLE_BATCH = 16
SECONDS = 8.0
REMOTE_WORKERS = 2
GOALS = {"sample": "≥ 1.0×, p99 ≤ 10 ms", "grade": "≥ 1.0×, p99 ≤ 100 ms"}
POSTGRESQL_GOALS = {"sample": "", "grade": "≥ 0.7×"}
# Every sampled step's table is kept, so that each /grade finds the step it grades (a trainer grades the step it
# just sampled; this load samples thousands first).
KEEP_TABLES = {"PROCTOR_EXPERIENCE_KEEP_ITERATIONS": "1000000"}


async def measure(
    port: int,
    seconds: float,
    answer_of: Callable[[str], str],
    *,
    concurrency: int = CONCURRENCY,
    pid: int | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Row]:
    """The two rows, ``/sample`` then ``/grade``, against the server on ``port``; with ``pid``, each with that
    process's CPU time per request. ``on_phase`` is called with ``"sample"``, then ``"grade"``, as each load
    begins."""

    async def timed(phase: str, name: str, fn: Callable[[Connection], Awaitable[None]]) -> Row:
        if on_phase is not None:
            on_phase(phase)
        before = 0.0 if pid is None else process_cpu_s(pid)
        latencies, elapsed = await drive(fn, seconds=seconds, concurrency=concurrency, host="127.0.0.1", port=port)
        measured = row(name, latencies, elapsed)
        if pid is not None and latencies:
            measured.cpu_ms = (process_cpu_s(pid) - before) * 1000 / len(latencies)
        return measured

    iterations = itertools.count()
    served: list[tuple[int, list[str]]] = []

    async def new_sample(c: Connection) -> None:
        step = next(iterations)
        answer = await c.json("POST", "/sample", {"iteration": step, "batch_size": SAMPLE_BATCH})
        served.append((step, [s["sample_id"] for s in answer["samples"]]))

    sample = await timed("sample", f"/sample new iteration (batch {SAMPLE_BATCH})", new_sample)
    requests = itertools.count()
    group = GRADE_ITEMS // SAMPLE_BATCH

    async def grade(c: Connection) -> None:
        # A trainer's /grade: one sampled step's prompts, each with its group of completions.
        n = next(requests)
        step, ids = served[n % len(served)]
        items = [
            {
                "sample_id": sid,
                "slot": slot,
                "completion_index": k,
                "completion": completion(answer_of(sid), n, slot * group + k, False),
            }
            for slot, sid in enumerate(ids)
            for k in range(group)
        ]
        await c.json("POST", "/grade", {"iteration": step, "items": items})

    graded = await timed("grade", f"/grade ({GRADE_ITEMS} completions)", grade)
    return {"sample": sample, "grade": graded}


def on_server(
    folder: Path,
    curriculum: Path,
    answer_of: Callable[[str], str],
    seconds: float,
    database_url: str,
    *,
    env: dict[str, str] | None = None,
    name: str = "server",
) -> dict[str, Row]:
    """The two loads against a ``proctor serve`` of ``database_url`` (``env`` added to its environment: a
    ``PYTHONPATH`` runs another checkout), its log in ``folder / f"{name}.log"``."""
    args = [str(curriculum), "--database-url", database_url, "--log-level", "warning"]
    with ServerProcess(args, log=folder / f"{name}.log", cwd=ROOT, env={**KEEP_TABLES, **(env or {})}) as server:
        return asyncio.run(measure(server.port, seconds, answer_of, pid=server.pid))


def with_grade_workers(
    folder: Path,
    curriculum: Path,
    answer_of: Callable[[str], str],
    seconds: float,
    *,
    env: dict[str, str] | None = None,
    name: str = "remote",
) -> Row:
    """The ``/grade`` load against a server that grades nothing itself, its grader role in two ``proctor
    grade-worker`` processes (one grader process each: as many as the server's own pool has on this machine);
    ``env`` is added to the server's and the workers' environment."""
    args = [str(curriculum), "--database-url", str(folder / f"{name}.db"), "--log-level", "warning"]
    env = {**KEEP_TABLES, **(env or {})}
    with (
        ServerProcess([*args, "--grader-workers", "0"], log=folder / f"{name}.log", cwd=ROOT, env=env) as server,
        grade_workers(server.url, env),
    ):
        return asyncio.run(measure(server.port, seconds, answer_of, pid=server.pid))["grade"]


@contextlib.contextmanager
def grade_workers(url: str, env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The benchmark's ``proctor grade-worker`` processes for the server at ``url`` (one grader process each),
    once each has asked the server for rows; stopped on leaving."""
    # The worker's defaults: a dispatch takes up to 256 rows from up to 8 tables, so the rows of up to four
    # /grade requests (a table each) in one request and one grading batch.
    cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", url, "--workers", "1"]
    workers = [
        subprocess.Popen(
            [*cmd, "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **env}
        )
        for _ in range(REMOTE_WORKERS)
    ]
    try:
        deadline = time.monotonic() + 60
        while dispatch_requests(url) < REMOTE_WORKERS and time.monotonic() < deadline:
            time.sleep(0.05)
        yield workers
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=30)


def environment(seconds: float) -> dict[str, Any]:
    """The machine and the load's shape, for the results."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "concurrency": CONCURRENCY,
        "seconds": seconds,
    }


def run(seconds: float = SECONDS) -> dict[str, Any]:
    results: dict[str, Any] = {"env": environment(seconds)}
    with tempfile.TemporaryDirectory(prefix="proctor-rollout-path-") as tmp:
        folder = Path(tmp)
        curriculum, answer_of = write_rows(folder)
        baseline = ServerProcess(
            [str(folder / "rows.jsonl")],
            log=folder / "baseline.log",
            cwd=ROOT,
            module="bench.bare_baseline",
            subcommand=None,
        )
        with baseline:
            bare = asyncio.run(measure(baseline.port, seconds, answer_of, pid=baseline.pid))
        now = on_server(folder, curriculum, answer_of, seconds, str(folder / "state.db"))
        # The same server, its state in a PostgreSQL database on this machine.
        with cluster() as pg:
            on_postgresql = on_server(folder, curriculum, answer_of, seconds, pg.new_database(), name="postgresql")
        remote = with_grade_workers(folder, curriculum, answer_of, seconds)
    results["proctor"] = {k: asdict(v) for k, v in now.items()}
    results["postgresql"] = {k: asdict(v) for k, v in on_postgresql.items()}
    results["remote"] = asdict(remote)
    results["baseline"] = {k: asdict(v) for k, v in bare.items()}
    return results


def write_rows(folder: Path) -> tuple[Path, Callable[[str], str]]:
    """The benchmark's curriculum in ``folder`` (:func:`write_curriculum`), and each sample id's answer."""
    curriculum, records = write_curriculum(folder)

    def answer_of(sample_id: str) -> str:
        # Both servers end a sample id with the record's place in the file.
        return records[int(sample_id.rsplit(":", 1)[1])]["answer"]

    return curriculum, answer_of


def _compared(
    results: dict[str, Any], side: str, base: str, heads: tuple[str, str, str], goals: dict[str, str]
) -> list[str]:
    """Rows of ``/sample`` and ``/grade``: ``side``'s rates and p99 beside ``base``'s, and their ratio."""
    lines = [
        f"| endpoint | {heads[0]} req/s | {heads[0]} p99 ms | {heads[0]} CPU ms/req | {heads[1]} req/s | "
        f"{heads[1]} p99 ms | {heads[1]} CPU ms/req | {heads[2]} | goal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for key in ("sample", "grade"):
        a, b = Row(**results[side][key]), Row(**results[base][key])
        ratio = a.per_second / b.per_second if b.per_second else float("nan")
        lines.append(
            f"| {a.name} | {a.per_second:.0f} | {a.p99_ms:.1f} | {_cpu(a)} | {b.per_second:.0f} | {b.p99_ms:.1f} | "
            f"{_cpu(b)} | {ratio:.2f}× | {goals[key]} |"
        )
    return lines


def _cpu(r: Row) -> str:
    return "" if r.cpu_ms is None else f"{r.cpu_ms:.2f}"


def table(results: dict[str, Any]) -> str:
    lines = _compared(results, "proctor", "baseline", ("proctor", "baseline", "proctor ÷ baseline"), GOALS)
    heads = ("PostgreSQL", "SQLite", "PostgreSQL ÷ SQLite")
    lines += ["", *_compared(results, "postgresql", "proctor", heads, POSTGRESQL_GOALS)]
    remote, local = Row(**results["remote"]), Row(**results["proctor"]["grade"])
    lines += [
        "",
        "| /grade's grader role | req/s | p99 ms | server CPU ms/req | ÷ the server's pool | goal |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        f"| the server's pool | {local.per_second:.0f} | {local.p99_ms:.1f} | {_cpu(local)} | 1.00× | |",
        f"| {REMOTE_WORKERS} `proctor grade-worker`s, 1 grader process each | {remote.per_second:.0f} | "
        f"{remote.p99_ms:.1f} | {_cpu(remote)} | {remote.per_second / local.per_second:.2f}× | ≥ 0.9× |",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench rollout_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"per measurement (default {SECONDS:g})")
    args = parser.parse_args(argv)
    results = run(args.seconds)
    env = results["env"]
    print(
        f"rollout path against its bare baseline, {CONCURRENCY} connections, {env['cpus']} CPUs, "
        f"Python {env['python']}, {env['seconds']:g} s each"
    )
    print(table(results))
    save("rollout_path", results)


if __name__ == "__main__":
    main()
