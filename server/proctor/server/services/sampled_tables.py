"""The tables of sampled steps: each step ``/sample`` serves gets its table in the experience store, each slot
with its prompt's columns (``sample_id``, ``prompt``, ``reference``, ``stage``), in the commit that records the
step. Functions named for the store's thread run there (:meth:`AsyncExperienceStore.call`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from proctor.experience import ExperienceError, ExperienceStore, TableInfo, UnknownIterationError
from proctor.experience import columns as col
from proctor.server.curriculum.loader import Curriculum
from proctor.server.services.batches import ServedBatch
from proctor.server.services.placement import reference
from proctor.server.sources.base import SampleId
from proctor.server.state.rows import IterationRow
from proctor.server.store import Store

__all__ = ["SampledStep", "SampledTables", "open_all_sampled", "open_sampled", "record_refill"]


def open_all_sampled(experience: ExperienceStore, curriculum: Curriculum, steps: Sequence[SampledStep]) -> None:
    """Open the tables of sampled steps in one commit; a step older than every table kept is left without."""
    with experience.batch():
        for step in steps:
            with contextlib.suppress(UnknownIterationError):
                open_sampled(experience, curriculum, step)


class SampledTables:
    """Opens each new step's table in the transaction that records the step (:meth:`AsyncStore.join`): a step
    is on disk with its table, or not at all, and ``/sample`` waits for one commit, not two."""

    def __init__(self, experience: ExperienceStore, curriculum: Curriculum, opened: Callable[[int], None]) -> None:
        self._experience = experience
        self._curriculum = curriculum
        self._opened = opened  # told of each step whose table the commit opened
        self._refused: set[int] = set()  # written on the store's thread, read on the loop after the commit

    def transaction(self) -> AbstractContextManager[None]:
        return self._experience.batch()

    def recorded(self, rows: Sequence[IterationRow]) -> None:
        experience, curriculum = self._experience, self._curriculum
        for row in rows:
            try:
                open_sampled(experience, curriculum, SampledStep.recorded(row, curriculum))
            except UnknownIterationError:
                pass  # older than every table kept
            except ExperienceError:
                # The store refused this table (a trainer opened it first with another shape, say): the step
                # stays sampled, and its next /sample opens it again, answering the refusal.
                self._refused.add(row.iteration)

    def committed(self, rows: Sequence[IterationRow]) -> None:
        for row in rows:
            if row.iteration in self._refused:
                self._refused.discard(row.iteration)
            else:
                self._opened(row.iteration)


def record_refill(
    state: Store,
    experience: ExperienceStore,
    iteration: int,
    round_: int,
    detail: dict[str, Any],
    samples_json: str,
    new_ids: Sequence[str],
    replaced: Mapping[int, int],
) -> None:
    with experience.batch():
        state.record_refill(iteration, round_, detail, samples_json, new_ids)
        # A replaced group of an earlier round sits in a slot past the batch, which the table does not have.
        slots = sorted(s for s in replaced if experience.has(iteration) and s < experience.table(iteration).slots)
        if slots:
            experience.put_slots(iteration, slots, {col.REPLACED_BY: [replaced[s] for s in slots]})


@dataclass(frozen=True, slots=True)
class SampledStep:
    """What opening a sampled step's table needs of its batch."""

    iteration: int
    batch_size: int
    sample_ids: Sequence[str]
    stage_name: str

    @classmethod
    def served(cls, batch: ServedBatch) -> SampledStep:
        # The batch's own slots: those its refill rounds added hold loose completions.
        return cls(batch.iteration, batch.batch_size, batch.sample_ids[: batch.batch_size], batch.stage_name)

    @classmethod
    def recorded(cls, row: IterationRow, curriculum: Curriculum) -> SampledStep:
        ids = [str(s["sample_id"]) for s in row.samples[: row.batch_size]]
        return cls(row.iteration, row.batch_size, ids, curriculum.stages[row.stage].name)


def open_sampled(experience: ExperienceStore, curriculum: Curriculum, served: SampledStep) -> TableInfo:
    """Open a sampled step's table with the prompt's columns of each slot (on the store's thread: it grows
    with the batch)."""
    prompts: list[str] = []
    references: list[dict[str, Any]] = []
    for sample_id in served.sample_ids:
        sid = SampleId.parse(sample_id)
        src = curriculum.sources.get(sid.source)
        if src is None or src.version != sid.version:
            # Its data or settings changed since the step was sampled: the record behind the key is another.
            stale = f"stale sample_id {sample_id!r}: its source changed since this step was sampled; not graded"
            prompts.append("")
            references.append({"answer": None, "metadata": {}, "stale": stale})
            continue
        record = src.record(sid.key)
        prompts.append(record.prompt)
        references.append(reference(record))
    experience.open(served.iteration, slots=served.batch_size)
    slots = list(range(served.batch_size))
    step = experience.limits.max_rows_per_call
    for start in range(0, len(slots), step):
        part = slots[start : start + step]
        experience.put_slots(
            served.iteration,
            part,
            {
                col.SAMPLE_ID: [served.sample_ids[s] for s in part],
                col.PROMPT: [prompts[s] for s in part],
                col.REFERENCE: [references[s] for s in part],
                col.STAGE: [served.stage_name] * len(part),
            },
        )
    return experience.table(served.iteration)
