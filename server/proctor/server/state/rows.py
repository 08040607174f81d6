"""The rows of a run's state: what the store reads and writes, and the domain computes with. Every sampled
iteration's batch (and an adaptive stage's decision), every grade, every stage transition, and the totals the
live page shows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proctor.server.state.items import GroupState, ItemState

__all__ = [
    "NO_SLOT",
    "DecisionRow",
    "GradeKey",
    "GradeOutcome",
    "GradeRow",
    "GroupChange",
    "IterationRow",
    "IterationTotals",
    "StageTotals",
    "StoredGrades",
    "TransitionRecord",
]

NO_SLOT = -1  # the slot of a grade whose client did not send one (it is told apart by its sample_id alone)


@dataclass(frozen=True, slots=True)
class DecisionRow:
    """An adaptive stage's decision for one iteration: the samplers' state after it, what the page shows of
    it, and the records it served in an epoch (``(source, key, epoch)``), which are marked served."""

    sampler: str
    state: dict[str, Any]
    detail: dict[str, Any]
    served: Sequence[tuple[str, int, int]] = ()


@dataclass(frozen=True, slots=True)
class IterationRow:
    iteration: int
    batch_size: int
    stage: int
    samples: list[dict[str, Any]]
    decision: DecisionRow | None = None


# (iteration, sample_id, slot or NO_SLOT, completion_index, sha256 of the completion): what makes a grade
# "the same grade".
GradeKey = tuple[int, str, int, int, str]
GradeOutcome = Literal["inserted", "replaced_error", "exists"]


@dataclass(frozen=True, slots=True)
class GradeRow:
    key: GradeKey
    stage: int
    source: str
    reward: float
    components: dict[str, float]
    error: str | None
    details: dict[str, Any] = field(default_factory=dict)  # what led to each grader's score, where it said


@dataclass(frozen=True, slots=True)
class GroupChange:
    """A group that got grades: its key, its record's source, its state before (``n == 0`` when new) and after."""

    iteration: int
    sample_id: str
    slot: int
    source: str
    before: GroupState
    after: GroupState


@dataclass(frozen=True, slots=True)
class StoredGrades:
    """What :meth:`Store.insert_grades` did: an outcome per row, the new state of each record the new grades
    touched (``(source, key, state)``), and the groups they changed."""

    outcomes: list[GradeOutcome]
    items: list[tuple[str, int, ItemState]]
    groups: list[GroupChange]


@dataclass(frozen=True, slots=True)
class IterationTotals:
    """One iteration's grades, for the live page."""

    iteration: int
    stage: int
    graded: int
    errors: int
    reward_sum: float
    groups: int
    zero_variance_groups: int


@dataclass(frozen=True, slots=True)
class StageTotals:
    iterations: int = 0
    samples: int = 0
    graded: int = 0
    errors: int = 0
    reward_sum: float = 0.0


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """A stage transition, recorded before the iteration it takes effect at."""

    iteration: int
    from_stage: int
    to_stage: int
    reason: str
    rolling_reward: float | None = None
    rolling_count: int | None = None
