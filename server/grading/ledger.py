"""Where grades become durable and count: each is stored once, and only a grade stored for the first time
(or one replacing a failed grade) counts in the curriculum's statistics and the metrics.

``/grade`` and the grader role's collections both record through it, so a completion graded by either
counts once, however often it is posted or re-dispatched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from proctor.server.context import ServingContext
from proctor.server.store import GradeKey, GradeRow

__all__ = ["GradeLedger"]

_GRADES_PER_COMMIT = 256


class GradeLedger:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def record(self, rows: Sequence[GradeRow]) -> set[GradeKey]:
        """Store and count ``rows``; returns the keys that were stored already (and so not counted again)."""
        ctx = self.ctx
        known: set[GradeKey] = set()
        # Stored (and counted) a slice at a time; each grade is idempotent, so a slice is a unit of its own.
        for start in range(0, len(rows), _GRADES_PER_COMMIT):
            part = rows[start : start + _GRADES_PER_COMMIT]
            stored = await ctx.storage.insert_grades(part)
            known.update(row.key for row, status in zip(part, stored.outcomes, strict=True) if status == "exists")
            counted, touched = ctx.progress.graded(part, stored)
            ctx.metrics.count_grades(ctx.curriculum, ctx.progress.statistics, counted, touched)
            await asyncio.sleep(0)
        return known
