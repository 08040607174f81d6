"""One completion's reward from the outcomes of its source's graders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proctor.server.grading.outcome import GraderOutcome
from proctor.server.grading.registry import JudgeGrader, LocalGrader, RemoteGrader, SourceGraders

__all__ = ["ComposedGrade", "compose", "weighted_reward"]


@dataclass(frozen=True, slots=True)
class ComposedGrade:
    reward: float
    components: dict[str, float]  # the score of each grader that gave one
    error: str | None  # the failures, when any grader gave no score
    details: dict[str, Any] = field(default_factory=dict)  # what led to each score, from graders that said


def weighted_reward(graders: SourceGraders, scores: Mapping[str, float]) -> float:
    """Weighted mean of the additive graders' scores, times every multiplicative grader's score."""
    every: tuple[LocalGrader | RemoteGrader | JudgeGrader, ...] = (*graders.local, *graders.remote, *graders.judges)
    additive = [g for g in every if not g.multiplicative]
    reward = sum(g.weight * scores[g.key] for g in additive) / sum(g.weight for g in additive)
    for g in every:
        if g.multiplicative:
            reward *= scores[g.key]
    return reward


def compose(graders: SourceGraders, outcomes: Mapping[str, GraderOutcome]) -> ComposedGrade:
    """The reward for ``outcomes`` (one per grader key of the source), or, when any grader failed, the
    source's ``on_error`` reward with the failures in the order the curriculum lists the graders: an error is
    never a silent 0."""
    components = {key: o.score for key, o in outcomes.items() if o.score is not None}
    details = {key: dict(o.detail) for key, o in outcomes.items() if o.detail is not None}
    failures = [outcomes[key].message for key in graders.names if outcomes[key].failure is not None]
    if failures:
        return ComposedGrade(graders.on_error, components, "; ".join(failures), details)
    return ComposedGrade(weighted_reward(graders, components), components, None, details)
