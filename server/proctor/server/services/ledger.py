"""Where stored grades count: only a grade stored for the first time (or one replacing a failed grade) counts
in the curriculum's statistics and the metrics.

Grades are stored by the grader role's collections (:meth:`proctor.server.services.rollouts.Rollouts.collect`), in the
transaction that writes their rewards to the experience store; whoever collected them (``/grade`` grading its
own rows, the server's role, a remote ``proctor grade-worker``) counts them here, once per completion.
"""

from __future__ import annotations

from collections.abc import Sequence

from proctor.server.services.context import ServingContext
from proctor.server.state.rows import GradeRow, StoredGrades

__all__ = ["GradeLedger"]


class GradeLedger:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def count(self, rows: Sequence[GradeRow], stored: StoredGrades) -> None:
        """Count ``rows``, as the state file stored them (``stored``), in the statistics and the metrics."""
        ctx = self.ctx
        counted, touched = ctx.progress.graded(rows, stored)
        stages = ctx.progress.statistics.stages
        ctx.metrics.count_grades(
            ctx.curriculum.stage_names, counted, {stage: stages[stage].rolling for stage in touched}
        )
