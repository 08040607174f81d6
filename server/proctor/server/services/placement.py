"""Placing completions in the experience store's rows, on the store's thread: each in its step's slot, or in
the step's table of loose completions (:func:`~proctor.experience.columns.loose_table`) when it fills none.
:meth:`AsyncExperienceStore.call` runs :func:`enqueue` and :func:`write_graded` there."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proctor.experience import ExperienceInputError, ExperienceStore, RowKey, Value
from proctor.experience import columns as col
from proctor.server.services.recording import store_grades
from proctor.server.sources.base import Record
from proctor.server.state.rows import NO_SLOT, GradeRow, StoredGrades
from proctor.server.store import Store

__all__ = [
    "Completion",
    "Graded",
    "StoredGraded",
    "check_indices",
    "enqueue",
    "place",
    "place_loose",
    "reference",
    "write_completions",
    "write_graded",
]


@dataclass(frozen=True, slots=True)
class Completion:
    """A completion ``/grade`` hands the store: the step it belongs to and, when it fills one, its slot."""

    step: int
    step_slot: int | None
    sample_id: str
    completion_index: int
    completion: str
    completion_tokens: int | None
    record: Record
    position: int = 0
    """Its place in the request, for errors."""
    regrade: bool = False
    """Its stored grade is a grader's error: it is graded again, in a row of its own."""


@dataclass(frozen=True, slots=True)
class Graded:
    """A completion that a ``/grade`` graded itself, as the grader role, before writing anything: its reward,
    the reward's detail (``reward_detail``'s cell) and its grade."""

    completion: Completion
    reward: float
    detail: Value
    grade: GradeRow


@dataclass(frozen=True, slots=True)
class StoredGraded:
    """What one transaction of graded completions wrote: :class:`Written`'s rows and collected rows for all its
    completions, and the grades it stored, in slices (see :class:`Recorded`)."""

    rows: list[tuple[int, int, int]]
    collected: set[tuple[int, int, int]]
    parts: list[tuple[list[GradeRow], StoredGrades]]


def reference(record: Record) -> dict[str, Any]:
    """A record's ``reference`` cell: what its graders check a completion against."""
    return {"answer": record.answer, "metadata": dict(record.metadata)}


def enqueue(
    experience: ExperienceStore,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    completions: Sequence[Completion],
    stage_names: Mapping[int, str],
) -> list[tuple[int, int, int]]:
    """:meth:`Rollouts.enqueue` on the store's thread: every call of the store's runs there one at a time, so
    what this reads is still so when it writes. The request is checked first (a refused one writes nothing),
    then its writes are one commit."""
    check_indices(experience, completions)
    with _placing(experience, loose_slots):
        return place(experience, loose_slots, completions, stage_names)


def write_graded(
    experience: ExperienceStore,
    state: Store,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    graded: Sequence[Graded],
    stage_names: Mapping[int, str],
    lease_s: float,
) -> StoredGraded:
    """:meth:`Rollouts.write_graded` on the store's thread: the completions placed, their rows leased to the
    grader role and collected with their rewards, their grades stored, in one transaction."""
    completions = [g.completion for g in graded]
    check_indices(experience, completions)
    with _placing(experience, loose_slots):
        rows = place(experience, loose_slots, completions, stage_names)
        at = {row: n for n, row in enumerate(rows)}
        by_table: dict[int, list[RowKey]] = {}
        for table, slot, index in rows:
            by_table.setdefault(table, []).append((slot, index))
        grades: list[GradeRow] = []
        collected: set[tuple[int, int, int]] = set()
        for table, keys in by_table.items():
            # Rows already graded, or held by another holder of the role, are left out of the lease.
            lease = experience.claim(col.GRADER.name, table, keys, lease_s=lease_s, read=False)
            if lease.lease is None:
                continue
            mine = [graded[at[(table, slot, index)]] for slot, index in lease.rows]
            experience.collect(
                lease.lease, {col.REWARD: [g.reward for g in mine], col.REWARD_DETAIL: [g.detail for g in mine]}
            )
            grades.extend(g.grade for g in mine)
            collected.update((table, slot, index) for slot, index in lease.rows)
        # All the grades in one store of them: it costs about the same for one row as for a few hundred.
        return StoredGraded(rows, collected, store_grades(state, grades))


@contextmanager
def _placing(
    experience: ExperienceStore, loose_slots: dict[int, dict[tuple[int, str, int], list[int]]]
) -> Iterator[None]:
    """One transaction of placed completions. The slots a failed one added were rolled back with it: the index
    of loose slots is dropped, to be read from the tables again."""
    try:
        with experience.batch():
            yield
    except BaseException:
        loose_slots.clear()
        raise


def check_indices(experience: ExperienceStore, completions: Sequence[Completion]) -> None:
    """A completion for a slot of a step whose table has a group size must have an index below it."""
    steps = {c.step for c in completions if c.step_slot is not None}
    groups = {step: experience.table(step).group_size for step in steps if experience.has(step)}
    for c in completions:
        group = groups.get(c.step) if c.step_slot is not None else None
        if group is not None and c.completion_index >= group:
            raise ExperienceInputError(
                f"items[{c.position}].completion_index",
                f"{c.completion_index} is not below the group size {group} of iteration {c.step}'s table; send "
                "each completion's index among its prompt's completions, from 0",
            )


def place(
    experience: ExperienceStore,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    completions: Sequence[Completion],
    stage_names: Mapping[int, str],
) -> list[tuple[int, int, int]]:
    """Write each completion to its row, ``(table, slot, index)``: its step's slot, or a loose one."""
    placed: list[tuple[int, int, int] | None] = [None] * len(completions)
    loose: list[int] = []
    by_step: dict[int, list[int]] = {}
    slots: dict[int, int] = {}  # each step's slots (0 for a step whose table is gone), looked up once
    for n, c in enumerate(completions):
        if c.step_slot is not None and c.step not in slots:
            slots[c.step] = experience.table(c.step).slots if experience.has(c.step) else 0
        if c.step_slot is not None and c.step_slot < slots[c.step]:
            by_step.setdefault(c.step, []).append(n)
        else:  # no slot in its step's table (a refill's slot past the batch), or a step retention dropped
            loose.append(n)
    for step, ns in by_step.items():
        keys = [(completions[n].step_slot or 0, completions[n].completion_index) for n in ns]
        held = experience.read(step, keys, (col.COMPLETION,), missing="none")[col.COMPLETION]
        new: list[tuple[int, RowKey]] = []
        for n, key, text in zip(ns, keys, held, strict=True):
            c = completions[n]
            if text is not None and (text != c.completion or c.regrade):
                loose.append(n)  # another completion of that row (a regenerated step), or a regrade
                continue
            placed[n] = (step, *key)
            if text is None:
                new.append((n, key))
        if new:
            write_completions(experience, step, [key for _, key in new], [completions[n] for n, _ in new])
    for n, where in zip(
        loose, place_loose(experience, loose_slots, [completions[n] for n in loose], stage_names), strict=True
    ):
        placed[n] = where
    return [p for p in placed if p is not None]


def write_completions(
    experience: ExperienceStore, table: int, rows: Sequence[RowKey], completions: Sequence[Completion]
) -> None:
    experience.put(
        table,
        rows,
        {
            col.COMPLETION: [c.completion for c in completions],
            col.COMPLETION_TOKENS: [c.completion_tokens for c in completions],
        },
    )


def place_loose(
    experience: ExperienceStore,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    completions: Sequence[Completion],
    stage_names: Mapping[int, str],
) -> list[tuple[int, int, int]]:
    """Rows for completions that fill no slot of their step, in its table of loose completions: a slot per
    ``(step, sample_id, step_slot)``, and another when the row of a completion index holds another completion
    already."""
    by_table: dict[int, list[int]] = {}
    for n, c in enumerate(completions):
        by_table.setdefault(_loose_home(experience, c.step), []).append(n)
    out: dict[int, tuple[int, int, int]] = {}
    # Newest first: opening a table may drop the oldest kept, which a later one then gives way for.
    for home, ns in sorted(by_table.items()):
        table = _loose_home(experience, -home - 1)  # again: opening a newer one may have dropped it
        placed: dict[int, tuple[int, int]] = {}
        exists = experience.has(table)
        if not exists:
            loose_slots[table] = {}
        slots = _loose_index(experience, loose_slots, table) if exists else loose_slots[table]
        # A slot of the same prompt whose row of that index is free or holds the same completion, else a new one.
        asked = sorted(
            {(s, completions[n].completion_index) for n in ns for s in slots.get(_prompt_key(completions[n]), [])}
        )
        held: dict[tuple[int, int], Any] = {}
        if asked:
            texts = experience.read(table, asked, (col.COMPLETION,), missing="none")[col.COMPLETION]
            held = dict(zip(asked, texts, strict=True))
        fresh: dict[tuple[int, str, int], list[int]] = {}  # new slots, numbered -1, -2, … until added
        write: list[int] = []
        for n in ns:
            c = completions[n]
            key, k = _prompt_key(c), c.completion_index
            choices = [*slots.get(key, []), *fresh.get(key, [])]
            free: tuple[object, ...] = (None,) if c.regrade else (None, c.completion)
            found = next((s for s in choices if held.get((s, k)) in free), None)
            if found is None:
                found = -1 - sum(map(len, fresh.values()))
                fresh.setdefault(key, []).append(found)
            if held.get((found, k)) is None:
                write.append(n)
                held[(found, k)] = c.completion
            placed[n] = (found, k)
        new = [(key, s) for key, ss in fresh.items() for s in ss]
        if new:
            if exists:
                first = experience.add_slots(table, len(new))
            else:
                first = 0
                experience.open(table, slots=len(new))
            number = {s: first + m for m, (_, s) in enumerate(new)}
            owner: dict[int, Completion] = {}
            for n in ns:
                s, k = placed[n]
                if s < 0:
                    placed[n] = (number[s], k)
                    owner.setdefault(number[s], completions[n])
            for key, s in new:
                slots.setdefault(key, []).append(number[s])
            cs = [owner[number[s]] for _, s in new]
            experience.put_slots(
                table,
                [number[s] for _, s in new],
                {
                    col.SAMPLE_ID: [c.sample_id for c in cs],
                    col.PROMPT: [c.record.prompt for c in cs],
                    col.REFERENCE: [reference(c.record) for c in cs],
                    col.STAGE: [stage_names[c.step] for c in cs],
                    col.STEP: [c.step for c in cs],
                    col.STEP_SLOT: [NO_SLOT if c.step_slot is None else c.step_slot for c in cs],
                },
            )
        if write:
            write_completions(experience, table, [placed[n] for n in write], [completions[n] for n in write])
        out.update((n, (table, *placed[n])) for n in ns)
    return [out[n] for n in range(len(completions))]


def _prompt_key(c: Completion) -> tuple[int, str, int]:
    return (c.step, c.sample_id, NO_SLOT if c.step_slot is None else c.step_slot)


def _loose_home(experience: ExperienceStore, step: int) -> int:
    """The table of a step's loose completions; the newest one kept when retention would refuse the step's
    own as too old."""
    table = col.loose_table(step)
    return table if experience.retains(table) else min(i for i in experience.kept() if i < 0)


def _loose_index(
    experience: ExperienceStore, loose_slots: dict[int, dict[tuple[int, str, int], list[int]]], table: int
) -> dict[tuple[int, str, int], list[int]]:
    """The slots of each prompt in a kept table of loose completions (read from the table once per run)."""
    known = loose_slots.get(table)
    info = experience.table(table)
    if known is not None and sum(map(len, known.values())) == info.slots:
        return known
    rows = [(s, 0) for s in range(info.slots)]
    values = experience.read(table, rows, (col.STEP, col.SAMPLE_ID, col.STEP_SLOT), missing="none")
    known = loose_slots[table] = {}
    for s, step, sample_id, step_slot in zip(
        range(info.slots), values[col.STEP], values[col.SAMPLE_ID], values[col.STEP_SLOT], strict=True
    ):
        if sample_id is not None:
            known.setdefault((int(step), str(sample_id), int(step_slot)), []).append(s)
    return known
