"""One completion's reward from the outcomes of its source's graders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proctor.server.grading.outcome import GraderOutcome
from proctor.server.grading.registry import LocalGrader, RemoteGrader, SourceGraders

__all__ = ["ComposedGrade", "compose", "weighted_reward"]


@dataclass(frozen=True, slots=True)
class ComposedGrade:
    reward: float
    components: dict[str, float]  # the score of each grader that gave one
    error: str | None  # the failures, when any grader gave no score


def weighted_reward(graders: SourceGraders, scores: Mapping[str, float]) -> float:
    """Weighted mean of the additive graders' scores, times every multiplicative grader's score."""
    every: tuple[LocalGrader | RemoteGrader, ...] = (*graders.local, *graders.remote)
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
    failures = [outcomes[key].message for key in graders.names if outcomes[key].failure is not None]
    if failures:
        return ComposedGrade(graders.on_error, components, "; ".join(failures))
    return ComposedGrade(weighted_reward(graders, components), components, None)
