"""The experience store's throughput: rows per second written and read, in-process (``ExperienceStore`` on a
file) and through the dataserver's ``/experience`` routes (``ExperienceClient``), side by side in one run; and what a
graded completion costs in storage (SQL rows written, bytes on disk), here and in the per-cell layout the
store had before (``--before REF``, run from a worktree of that commit).

Each step is a 1,024-row table (256 prompts × 4 completions) with a 512-token ``completion_ids`` column,
stored either as int32 arrays (the store's binary encoding: raw bytes in SQLite, base64 on the wire) or as
JSON lists of integers. A write is one ``put`` of every row's cell; a read is one ``read`` of them all.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench._baseline import available, checkout
from bench._results import save
from proctor.experience import ExperienceStore

if TYPE_CHECKING:
    from proctor.client import ExperienceClient

SLOTS, GROUP, TOKENS = 256, 4, 512
ROWS = SLOTS * GROUP


def _columns(step: int, encoding: str) -> dict[str, list[Any]]:
    rng = np.random.default_rng(step)
    ids = [rng.integers(0, 150_000, TOKENS, dtype=np.int32) for _ in range(ROWS)]
    return {"completion_ids": ids if encoding == "binary" else [a.tolist() for a in ids]}


def _measure(
    experience: ExperienceStore | ExperienceClient, encoding: str, steps: int, first: int = 0
) -> dict[str, float]:
    rows = [(s, k) for s in range(SLOTS) for k in range(GROUP)]
    write_s, read_s = [], []
    for step in range(first, first + steps):
        columns = _columns(step, encoding)
        experience.open(step, slots=SLOTS, group_size=GROUP)
        t0 = time.perf_counter()
        experience.put(step, rows, columns)
        write_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        experience.read(step, rows, ["completion_ids"])
        read_s.append(time.perf_counter() - t0)
    return {
        "write_rows_per_s": ROWS / statistics.median(write_s),
        "read_rows_per_s": ROWS / statistics.median(read_s),
    }


def run(steps: int) -> list[dict[str, Any]]:
    # Here, not at the top: before() imports this module against another commit's server and client.
    from proctor.cli.launcher import ServerProcess
    from proctor.client import ExperienceClient

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for encoding in ("binary", "json"):
            experience = ExperienceStore(Path(tmp, f"inproc-{encoding}.db"), keep_iterations=steps + 1)
            try:
                results.append({"face": "in-process", "encoding": encoding, **_measure(experience, encoding, steps)})
            finally:
                experience.close()
        server = ServerProcess(
            ["--database-url", str(Path(tmp, "server.db")), "--grader-workers", "0"],
            log=Path(tmp, "server.log"),
            env={"PROCTOR_EXPERIENCE_KEEP_ITERATIONS": str(2 * steps + 1)},
        ).start()
        try:
            for n, encoding in enumerate(("binary", "json")):
                with ExperienceClient(server.url) as client:
                    results.append(
                        {"face": "HTTP", "encoding": encoding, **_measure(client, encoding, steps, n * steps)}
                    )
        finally:
            server.stop()
    return results


# A GRPO step as the dataserver stores it: 16 prompts × 4 completions of about 40 words, graded.
COST_SLOTS, COST_GROUP, COST_STEPS = 16, 4, 20
CELL_LAYOUT = "79db5ef"  # the last commit whose store kept a SQL row per cell


def storage_cost(steps: int = COST_STEPS, store: type[ExperienceStore] = ExperienceStore) -> dict[str, float]:
    """SQL rows written and bytes on disk per graded completion, for ``steps`` steps written as the dataserver
    writes them (prompt columns, completions, the grader role's lease and rewards); the store's own tables
    only. ``store`` is the store's class (another commit's, for :func:`before`)."""
    rng = np.random.default_rng(0)
    rows = [(s, k) for s in range(COST_SLOTS) for k in range(COST_GROUP)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cost.db")
        experience = store(path, keep_iterations=steps + 1)
        experience.register("grader", needs=["sample_id", "completion"], produces=["reward", "reward_detail"])
        for step in range(steps):
            experience.open(step, slots=COST_SLOTS, group_size=COST_GROUP)
            prompts: dict[str, list[Any]] = {
                "sample_id": [f"add:0123456789:{step * COST_SLOTS + s}" for s in range(COST_SLOTS)],
                "prompt": [f"What is {s} + {step}? Think step by step." for s in range(COST_SLOTS)],
                "reference": [{"answer": str(s + step), "metadata": {}} for s in range(COST_SLOTS)],
                "stage": ["warm"] * COST_SLOTS,
            }
            if hasattr(experience, "put_slots"):
                experience.put_slots(step, list(range(COST_SLOTS)), prompts)
            else:  # the per-cell layout wrote them in every row
                experience.put(step, rows, {name: [v[s] for s, _ in rows] for name, v in prompts.items()})
            words = [" ".join(f"w{int(x)}" for x in rng.integers(0, 1000, 40)) for _ in rows]
            experience.put(step, rows, {"completion": [f"{w} so the answer is {n}" for n, w in enumerate(words)]})
            batch = experience.dispatch("grader", len(rows), iteration=step)
            assert batch.lease is not None
            detail = {"components": {"numeric": 1.0}, "error": None}
            experience.collect(batch.lease, {"reward": [1.0] * len(rows), "reward_detail": [detail] * len(rows)})
        experience.close()
        db = sqlite3.connect(path)
        tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        sql_rows = sum(
            db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables if not t.endswith("_consumers")
        )
        db.execute("VACUUM")
        db.close()
        completions = steps * len(rows)
        return {
            "rows_per_completion": sql_rows / completions,
            "bytes_per_completion": path.stat().st_size / completions,
        }


def in_process(steps: int = 5, store: type[ExperienceStore] = ExperienceStore) -> dict[str, float]:
    """Rows per second written and read in-process, binary encoding (a row of :func:`run`)."""
    with tempfile.TemporaryDirectory() as tmp:
        experience = store(Path(tmp, "inproc.db"), keep_iterations=steps + 1)
        try:
            return _measure(experience, "binary", steps)
        finally:
            experience.close()


def before(what: str, ref: str = CELL_LAYOUT) -> dict[str, float] | None:
    """This module's function ``what`` (:func:`storage_cost` or :func:`in_process`) run against the store of
    commit ``ref``; None when this clone lacks it."""
    if not available(ref):
        return None
    with checkout(ref) as (env, _module):
        # That commit's store, under the name it had then.
        code = (
            "import json; from proctor.dock import TransferDock; from bench.experience_throughput import "
            f"{what}; print(json.dumps({what}(store=TransferDock)))"
        )
        pythonpath = f"{env['PYTHONPATH']}:{Path(__file__).resolve().parents[1]}"
        done = subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONPATH": pythonpath}, capture_output=True, text=True, check=True
        )
    found: dict[str, float] = json.loads(done.stdout)
    return found


def cost_table(
    now: dict[str, float], then: dict[str, float] | None, speed: dict[str, float], speed_then: dict[str, float] | None
) -> str:
    lines = [
        "| store layout | SQL rows per graded completion | bytes per graded completion | in-process rows/s "
        "written | read |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, cost, rate in ((f"a row per cell ({CELL_LAYOUT})", then, speed_then), ("column chunks", now, speed)):
        if cost is not None and rate is not None:
            lines.append(
                f"| {name} | {cost['rows_per_completion']:.2f} | {cost['bytes_per_completion']:,.0f} | "
                f"{rate['write_rows_per_s']:,.0f} | {rate['read_rows_per_s']:,.0f} |"
            )
    return "\n".join(lines)


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"| {ROWS:,}-row steps, {TOKENS}-token completion_ids | written, rows/s | read, rows/s |",
        "|---|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['face']}, {r['encoding']} | {r['write_rows_per_s']:,.0f} | {r['read_rows_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench experience_throughput")
    parser.add_argument("--steps", type=int, default=5, help="tables written and read per variant (median)")
    args = parser.parse_args(list(argv))
    results = run(args.steps)
    cost, cost_then = storage_cost(), before("storage_cost")
    speed, speed_then = in_process(args.steps), before("in_process")
    save(
        "experience_throughput",
        {"throughput": results, "storage": {"chunks": cost, "cells": cost_then}, "layouts": [speed, speed_then]},
    )
    print(table(results))
    print()
    print(cost_table(cost, cost_then, speed, speed_then))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
