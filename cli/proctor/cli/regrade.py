"""``proctor regrade``: a dataserver's kept, graded completions graded again, with its graders as they are now
(or one of them), the scores written beside the old ones; then a table of how many verdicts changed, by source.

Runs the graders here, in grader processes of its own, as a ``proctor grade-worker`` does; started again after
any stop (``kill -9`` included), it goes on where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping

import httpx
from pydantic import SecretStr

from proctor.cli.export import iteration_range
from proctor.client.errors import DataserverError
from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.server.grade_worker import source_graders
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import local_refs
from proctor.server.regrade import Regrade, only_grader, verdict_changes
from proctor.server.settings import default_workers
from proctor.wire.dataserver import CurriculumState

__all__ = ["regrade"]


def regrade(args: argparse.Namespace) -> int:
    try:
        iterations = iteration_range(args.iterations)
    except ValueError as exc:
        print(f"proctor regrade: {exc}", file=sys.stderr)
        return 2
    client = ProctorClient(args.server, api_key=args.api_key or os.environ.get("PROCTOR_API_KEY"), retries=2)
    try:
        return asyncio.run(_regrade(args, client, iterations))
    except ValueError as exc:
        print(f"proctor regrade: {exc}", file=sys.stderr)
        return 2
    except DataserverError as exc:
        print(f"proctor regrade: the dataserver at {args.server} did not answer as asked: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()


async def _regrade(args: argparse.Namespace, client: ProctorClient, iterations: range | None) -> int:
    spec = await asyncio.to_thread(client.graders)
    graders = source_graders(spec)
    if args.grader is not None:
        graders = only_grader(graders, args.grader)
    if args.stage is not None:
        iterations = _stage_range(await asyncio.to_thread(client.curriculum), args.stage, iterations)
    experience = ExperienceClient(client=client)
    tables = sorted(
        (
            t.iteration
            for t in await asyncio.to_thread(experience.tables)
            if iterations is None or _step(t.iteration) in iterations
        ),
        key=lambda t: (_step(t), t < 0),
    )
    pool = GraderPool(args.workers or default_workers(), graders=local_refs(graders))
    await pool.start()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False) as http:
            judge_key = os.environ.get("PROCTOR_JUDGE_API_KEY")
            run = Regrade(
                experience,
                graders,
                pool,
                http,
                timeout_s=spec.timeout_s,
                rows_per_dispatch=args.rows_per_dispatch,
                judge_api_key=SecretStr(judge_key) if judge_key else None,
            )
            print(f"regrading {len(tables)} tables into {run.consumer.produces[0]} and {run.consumer.produces[1]}")
            stats = await run.run(tables)
    finally:
        await pool.close()
    changes = await asyncio.to_thread(verdict_changes, experience, tables, run.version)
    print(f"regraded {stats.regraded} completions here ({stats.refused} results refused: their lease had ended)")
    print(_table(changes))
    return 0


def _stage_range(state: CurriculumState, stage: str, iterations: range | None) -> range:
    """The iterations a stage served (from its start to the next stage's), within ``iterations``."""
    stages = state.stages
    names = [s.name for s in stages]
    if stage not in names:
        raise ValueError(f"--stage {stage!r}: the curriculum's stages are: {', '.join(names)}")
    n = names.index(stage)
    start = stages[n].started_at
    if start is None:
        return range(0)  # not reached yet: nothing to regrade
    ends = [s.started_at for s in stages[n + 1 :] if s.started_at is not None]
    served = range(start, ends[0] if ends else 2**62)
    if iterations is None:
        return served
    return range(max(served.start, iterations.start), min(served.stop, iterations.stop))


def _step(table: int) -> int:
    return table if table >= 0 else -table - 1


def _table(changes: Mapping[str, tuple[int, int, int]]) -> str:
    lines = [
        "| source | regraded | verdict changed | not graded (grader failed or absent) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for source, (rows, changed, failed) in changes.items():
        share = f" ({changed / rows:.1%})" if rows else ""
        lines.append(f"| {source} | {rows:,} | {changed:,}{share} | {failed:,} |")
    if not changes:
        lines.append("| (no graded completion in the tables asked for) | 0 | 0 | 0 |")
    return "\n".join(lines)
