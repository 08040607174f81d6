"""A collection by the grader role is a grade: on the store's thread, the collection, the grades read from the
rows' cells and their records' statistics are one transaction (:meth:`AsyncExperienceStore.call` runs these
there)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from proctor.experience import Collected, ExperienceError, ExperienceStore, LeaseError, Value
from proctor.experience import columns as col
from proctor.server.sources.base import SampleId
from proctor.server.state.rows import NO_SLOT, GradeKey, GradeRow, StoredGrades
from proctor.server.store import Store
from proctor.wire import experience as dw

__all__ = [
    "Recorded",
    "collect_and_record",
    "collect_many_wire",
    "collect_wire",
    "grade_key",
    "record",
    "store_grades",
]

T = TypeVar("T")

_GRADES_PER_PART = 256  # grades counted in the curriculum's statistics between two turns of the event loop


@dataclass(frozen=True, slots=True)
class Recorded:
    """A collection and the grades it stored, in slices of at most a few hundred (each with its outcomes),
    for the curriculum's statistics to count a slice at a time."""

    collected: Collected
    parts: list[tuple[list[GradeRow], StoredGrades]]
    rewards: tuple[Sequence[Value], Sequence[Value]] | None = None
    """The grader role's ``reward`` and ``reward_detail`` of the collected rows, in their order (None for
    another consumer's collection)."""


def collect_and_record(
    experience: ExperienceStore,
    state: Store,
    lease: str,
    columns: Mapping[str, Sequence[Value]],
    stage_of: Callable[[int], int],
) -> Recorded:
    """The collection and, for the grader role's, its grades: one transaction."""
    with experience.batch():
        return _recorded(experience, state, experience.collect(lease, columns), columns, stage_of)


def _recorded(
    experience: ExperienceStore,
    state: Store,
    collected: Collected,
    columns: Mapping[str, Sequence[Value]],
    stage_of: Callable[[int], int],
) -> Recorded:
    """A collection made: for the grader role's, its grades stored."""
    if collected.consumer != col.GRADER.name:
        return Recorded(collected, [])
    return record(experience, state, collected, columns, stage_of)


def collect_wire(
    experience: ExperienceStore,
    state: Store,
    lease: str,
    body: dw.CollectRequest,
    stage_of: Callable[[int], int],
    then: Callable[[ExperienceStore, str], T] | None,
) -> tuple[Recorded, T | ExperienceError | None]:
    with experience.batch():
        recorded = collect_and_record(experience, state, lease, dw.columns_from_wire(body.columns), stage_of)
        return recorded, _then(experience, recorded.collected.consumer, then)


def collect_many_wire(
    experience: ExperienceStore,
    state: Store,
    consumer: str,
    body: dw.CollectManyRequest,
    stage_of: Callable[[int], int],
    then: Callable[[ExperienceStore, str], T] | None,
) -> tuple[list[Recorded | LeaseError], T | ExperienceError | None]:
    """:func:`collect_wire` for several leases of ``consumer``: the collections, the grader role's grades and the
    next dispatch (``then``) are one transaction. A lease the store refuses is answered with its refusal."""
    results = [(c.lease, dw.columns_from_wire(c.columns)) for c in body.collections]
    with experience.batch():
        recorded: list[Recorded | LeaseError] = []
        for outcome, (_, columns) in zip(experience.collect_many(consumer, results), results, strict=True):
            if isinstance(outcome, LeaseError):
                recorded.append(outcome)
            else:
                recorded.append(_recorded(experience, state, outcome, columns, stage_of))
        return recorded, _then(experience, consumer, then)


def _then(
    experience: ExperienceStore, consumer: str, then: Callable[[ExperienceStore, str], T] | None
) -> T | ExperienceError | None:
    """``then`` after a collection, in its transaction; a refusal (raised before it writes anything) is returned,
    and the collection commits without it."""
    if then is None:
        return None
    try:
        return then(experience, consumer)
    except ExperienceError as exc:
        return exc


def record(
    experience: ExperienceStore,
    state: Store,
    collected: Collected,
    columns: Mapping[str, Sequence[Value]],
    stage_of: Callable[[int], int],
) -> Recorded:
    """Store the grades of rows the grader role collected, read from their cells (the reward's columns from
    ``columns`` where the collection carried them; a row without a reward has no grade)."""
    rewards = (col.REWARD, col.REWARD_DETAIL)
    loose = collected.iteration < 0
    where = (col.STEP, col.STEP_SLOT) if loose else ()
    names = (col.SAMPLE_ID, col.COMPLETION, *where, *(c for c in rewards if c not in columns))
    with experience.batch():
        read = experience.read(collected.iteration, collected.rows, names, missing="none")
        values = {**read, **{c: columns[c] for c in rewards if c in columns}}
        grades: list[GradeRow] = []
        for n, (slot, index) in enumerate(collected.rows):
            sample_id, reward = values[col.SAMPLE_ID][n], values[col.REWARD][n]
            if sample_id is None or reward is None:
                continue
            step, step_slot = collected.iteration, slot
            if loose:
                step, step_slot = int(values[col.STEP][n]), int(values[col.STEP_SLOT][n])
            key = grade_key(step, str(sample_id), step_slot, index, str(values[col.COMPLETION][n]))
            source = SampleId.parse(str(sample_id)).source
            parts = col.parse_reward_detail(values[col.REWARD_DETAIL][n])
            grades.append(GradeRow(key, stage_of(step), source, float(reward), *parts))
        return Recorded(collected, store_grades(state, grades), (values[col.REWARD], values[col.REWARD_DETAIL]))


def store_grades(state: Store, grades: Sequence[GradeRow]) -> list[tuple[list[GradeRow], StoredGrades]]:
    parts = [list(grades[start : start + _GRADES_PER_PART]) for start in range(0, len(grades), _GRADES_PER_PART)]
    return [(part, state.insert_grades(part)) for part in parts]


def grade_key(step: int, sample_id: str, step_slot: int | None, index: int, completion: str) -> GradeKey:
    """What makes a grade the same grade: see :data:`proctor.server.state.rows.GradeKey`."""
    sha = hashlib.sha256(completion.encode()).hexdigest()
    slot = NO_SLOT if step_slot is None or step_slot < 0 else step_slot
    return (step, sample_id, slot, index, sha)
