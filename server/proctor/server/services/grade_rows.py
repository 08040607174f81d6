"""Grading the rows the store hands the grader role: the same graders, composition and failure handling as
``/grade``, whether the role runs in the dataserver or in a ``proctor grade-worker`` elsewhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proctor.experience import Value
from proctor.experience import columns as col
from proctor.server.grading.base import GradeInput
from proctor.server.grading.compose import compose
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.registry import SourceGraders
from proctor.server.sources.base import SampleId

__all__ = ["grade_rows"]


async def grade_rows(
    fanout: GraderFanout, graders: Mapping[str, SourceGraders], columns: Mapping[str, Sequence[Value]]
) -> dict[str, list[Value]]:
    """The grader role's columns (``reward``, ``reward_detail``) for rows with the columns it needs.

    A row whose source has no graders here (a curriculum changed under a running worker) gets reward 0.0 and
    an error that says so, rather than stopping the role.
    """
    ids = columns[col.SAMPLE_ID]
    rewards: list[Value] = [0.0] * len(ids)
    details: list[Value] = [None] * len(ids)
    work: list[tuple[SourceGraders, GradeInput]] = []
    positions: list[int] = []
    for n, sample_id in enumerate(ids):
        source = _source(sample_id)
        found = graders.get(source) if source is not None else None
        if found is None:
            details[n] = col.reward_detail({}, f"no graders for the source of sample id {sample_id!r} here")
            continue
        reference: Any = columns[col.REFERENCE][n]
        if not isinstance(reference, dict):
            reference = {}
        if reference.get("stale"):
            rewards[n] = found.on_error
            details[n] = col.reward_detail({}, str(reference["stale"]))
            continue
        tokens = columns[col.COMPLETION_TOKENS][n]
        work.append(
            (
                found,
                GradeInput(
                    prompt=str(columns[col.PROMPT][n]),
                    completion=str(columns[col.COMPLETION][n]),
                    answer=reference.get("answer"),
                    metadata=reference.get("metadata") or {},
                    completion_tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
                ),
            )
        )
        positions.append(n)
    outcomes = await fanout.grade(work) if work else []
    for n, (found, _), per_grader in zip(positions, work, outcomes, strict=True):
        c = compose(found, per_grader)
        rewards[n] = c.reward
        details[n] = col.reward_detail(c.components, c.error, c.details)
    return {col.REWARD: rewards, col.REWARD_DETAIL: details}


def _source(sample_id: Value) -> str | None:
    try:
        return SampleId.parse(str(sample_id)).source
    except ValueError:
        return None
