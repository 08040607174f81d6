"""``proctor regrade``'s rate over stored completions, beside ``/grade``'s on the same completions, in one run.

A real dataserver process (the load curriculum: 5,000 arithmetic rows graded by ``math``) first grades
``--completions`` completions through ``/grade`` (1,024 a request, one step's prompts, each completion in its
prompt's slot, every fourth one right): that is the baseline, completions graded and stored per second. Then a
regrade of all of them runs here, as ``proctor regrade`` runs (its own grader processes, the store's rows leased
to it, 256 at a time), and every verdict is compared: completions regraded per second, and how many changed
(none should).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench._load import completion, write_curriculum
from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.server.grade_worker import source_graders
from proctor.server.grading.pool import GraderPool
from proctor.server.regrade import Regrade, verdict_changes

__all__ = ["main"]

PER_REQUEST = 1024


def run(completions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="proctor-regrade-") as tmp:
        path, rows = write_curriculum(Path(tmp))
        with ServerProcess(
            [str(path), "--database-url", str(Path(tmp) / "state.db"), "--log-level", "warning"],
            log=Path(tmp) / "server.log",
        ) as server:
            version = next(s["version"] for s in httpx.get(server.url + "/meta").json()["sources"])
            answers = {f"rows:{version}:{n}": r["answer"] for n, r in enumerate(rows)}
            with ProctorClient(server.url, timeout=300) as client:
                # A step a request, each completion in a slot of its own: the steps' tables hold them.
                steps = [
                    client.sample(i, PER_REQUEST).samples for i in range((completions + PER_REQUEST - 1) // PER_REQUEST)
                ]
                started = time.perf_counter()
                with httpx.Client(base_url=server.url, timeout=300) as http:
                    for i, samples in enumerate(steps):
                        items = [
                            {
                                "sample_id": s.sample_id,
                                "slot": s.slot,
                                "completion": completion(answers[s.sample_id], i, k, False),
                            }
                            for k, s in enumerate(samples[: completions - i * PER_REQUEST])
                        ]
                        answer = http.post("/grade", json={"iteration": i, "items": items})
                        if answer.status_code != 200:
                            raise RuntimeError(f"/grade answered {answer.status_code}: {answer.text[:300]}")
                graded_s = time.perf_counter() - started
                regraded, regrade_s, changes = asyncio.run(_regrade(client))
    changed = sum(c for _, c, _ in changes.values())
    return {
        "completions": completions,
        "grade_s": graded_s,
        "regraded": regraded,
        "regrade_s": regrade_s,
        "changed": changed,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
    }


async def _regrade(client: ProctorClient) -> tuple[int, float, dict[str, tuple[int, int, int]]]:
    spec = await asyncio.to_thread(client.graders)
    experience = ExperienceClient(client=client)
    tables = sorted(t.iteration for t in await asyncio.to_thread(experience.tables))
    pool = GraderPool(len(os.sched_getaffinity(0)))
    await pool.start()
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            regrade = Regrade(experience, source_graders(spec), pool, http, timeout_s=spec.timeout_s)
            started = time.perf_counter()
            stats = await regrade.run(tables)
            took = time.perf_counter() - started
    finally:
        await pool.close()
    return stats.regraded, took, await asyncio.to_thread(verdict_changes, experience, tables, regrade.version)


def table(result: dict[str, Any]) -> str:
    n = result["completions"]
    lines = [
        "| completions stored | graded and stored by /grade, per s | regraded, per s | regrade ÷ /grade "
        "| verdicts changed |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    grade_rate = n / result["grade_s"]
    regrade_rate = result["regraded"] / result["regrade_s"]
    ratio = regrade_rate / grade_rate
    lines.append(f"| {n:,} | {grade_rate:,.0f} | {regrade_rate:,.0f} | {ratio:.2f}× | {result['changed']:,} |")
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench regrade", description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=100_000, help="completions stored (default 100,000)")
    args = parser.parse_args(list(argv))
    if args.completions < 1:
        parser.error("--completions must be at least 1")
    result = run(args.completions)
    save("regrade", result)
    print(f"\nproctor regrade over stored completions, against /grade on the same ones ({result['machine']})")
    print(table(result))


if __name__ == "__main__":
    main(sys.argv[1:])
