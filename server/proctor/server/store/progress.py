"""What a restart and the live page read back: totals per stage and per iteration, recent rewards and
errors, the records' statistics, the adaptive stages' decisions."""

from __future__ import annotations

import json
from typing import Any

from proctor.server.state.items import ZERO_VARIANCE, GroupState
from proctor.server.state.rows import (
    IterationTotals,
    StageTotals,
)
from proctor.server.store.connection import StateConnection
from proctor.server.store.grades import _GRADE_SUMS

__all__ = ["ProgressQueries"]


class ProgressQueries(StateConnection):
    """The run's progress, read back."""

    def stage_totals(self) -> dict[int, StageTotals]:
        out: dict[int, dict[str, Any]] = {}
        for stage, iterations, samples in self._db.execute(
            "SELECT stage, COUNT(*), SUM(batch_size) FROM iterations GROUP BY stage"
        ):
            out.setdefault(stage, {}).update(iterations=iterations, samples=samples or 0)
        for stage, graded, errors, reward_sum in self._db.execute(
            "SELECT stage, " + _GRADE_SUMS + " FROM grades GROUP BY stage"
        ):
            out.setdefault(stage, {}).update(graded=graded or 0, errors=errors or 0, reward_sum=reward_sum or 0.0)
        return {stage: StageTotals(**fields) for stage, fields in out.items()}

    def recent_rewards(self, stage: int, limit: int) -> list[float]:
        """The latest ``limit`` error-free rewards of a stage, oldest first."""
        rows = self._db.execute(
            "SELECT reward FROM grades WHERE stage = ? AND error IS NULL ORDER BY seq DESC LIMIT ?",
            (stage, limit),
        ).fetchall()
        return [r[0] for r in reversed(rows)]

    def item_rows(self, source: str) -> list[tuple[int, float, float, int, int, int]]:
        """Every stored record of ``source``: ``(key, passes, fails, groups, streak, served_epoch)``."""
        rows = self._db.execute(
            "SELECT key, passes, fails, groups, streak, served_epoch FROM items WHERE source = ?", (source,)
        )
        return [(key, passes, fails, groups, streak, served) for key, passes, fails, groups, streak, served in rows]

    def latest_groups(self, limit: int) -> list[tuple[int, str, int, GroupState]]:
        """The latest ``limit`` groups by iteration, ``(iteration, sample_id, slot, state)``, oldest first."""
        rows = self._db.execute(
            "SELECT iteration, sample_id, slot, n, mean, m2 FROM groups"
            " ORDER BY iteration DESC, sample_id DESC, slot DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [
            (iteration, sample_id, slot, GroupState(n, mean, m2))
            for iteration, sample_id, slot, n, mean, m2 in reversed(rows)
        ]

    def last_decision(self) -> tuple[int, dict[str, Any]] | None:
        """The latest iteration an adaptive stage decided, and the samplers' state after it."""
        row = self._db.execute("SELECT iteration, state FROM decisions ORDER BY iteration DESC LIMIT 1").fetchone()
        return None if row is None else (int(row[0]), json.loads(row[1]))

    def decision_details(self, first: int) -> dict[int, tuple[str, dict[str, Any]]]:
        """``(sampler, detail)`` of the decided iterations from ``first`` on."""
        return {
            int(i): (sampler, json.loads(detail))
            for i, sampler, detail in self._db.execute(
                "SELECT iteration, sampler, detail FROM decisions WHERE iteration >= ?", (first,)
            )
        }

    def iteration_totals(self, first: int) -> list[IterationTotals]:
        """Per iteration from ``first`` on: its grades and its groups, in iteration order."""
        out: dict[int, dict[str, Any]] = {}
        for iteration, stage in self._db.execute(
            "SELECT iteration, stage FROM iterations WHERE iteration >= ? ORDER BY iteration", (first,)
        ):
            out[iteration] = {"stage": stage}
        for iteration, graded, errors, reward_sum in self._db.execute(
            "SELECT iteration, " + _GRADE_SUMS + " FROM grades WHERE iteration >= ? GROUP BY iteration",
            (first,),
        ):
            if iteration in out:
                out[iteration].update(graded=graded or 0, errors=errors or 0, reward_sum=reward_sum or 0.0)
        for iteration, counted, zero in self._db.execute(
            "SELECT iteration, SUM(CASE WHEN n >= 2 THEN 1 ELSE 0 END),"
            f" SUM(CASE WHEN n >= 2 AND m2 <= {ZERO_VARIANCE!r} THEN 1 ELSE 0 END) FROM groups WHERE iteration >= ?"
            " GROUP BY iteration",
            (first,),
        ):
            if iteration in out:
                out[iteration].update(groups=counted or 0, zero_variance_groups=zero or 0)
        return [
            IterationTotals(
                iteration,
                fields["stage"],
                fields.get("graded", 0),
                fields.get("errors", 0),
                fields.get("reward_sum", 0.0),
                fields.get("groups", 0),
                fields.get("zero_variance_groups", 0),
            )
            for iteration, fields in out.items()
        ]

    def recent_errors(self, limit: int) -> list[tuple[int, str, str]]:
        """The latest ``limit`` grader errors, newest first: ``(iteration, sample_id, error)``."""
        rows = self._db.execute(
            "SELECT iteration, sample_id, error FROM grades WHERE error IS NOT NULL ORDER BY seq DESC LIMIT ?",
            (limit,),
        )
        return [(iteration, sample_id, error) for iteration, sample_id, error in rows]
