"""The experience store as the dataserver uses it: the steps it sampled, the completions written to them, and
the grader role's rewards.

- Opening the table of a step that ``/sample`` served fills the prompt's columns of every row (``sample_id``,
  ``prompt``, ``reference``, ``stage``), so a trainer writes only its completions.
- A collection by the grader role (the dataserver's own pool or a remote ``proctor grade-worker``) is also a
  grade: it is stored and counted in the curriculum's statistics through the :class:`GradeLedger`, once
  per completion however often a row is re-dispatched.
- Waiters (the local grader role, ``/grade`` waiting for rewards) are woken when rows are written or graded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from proctor.dock import (
    CellConflictError,
    CellsMissingError,
    Collected,
    DockInputError,
    RowKey,
    ShapeConflictError,
    TableInfo,
    TransferDock,
    UnknownIterationError,
    Value,
)
from proctor.dock import columns as col
from proctor.dock import wire as dw
from proctor.server.batches import ServedBatch
from proctor.server.context import ServingContext
from proctor.server.curriculum.loader import Curriculum
from proctor.server.exceptions import RequestError, UnavailableError
from proctor.server.experience import ExperienceStore
from proctor.server.grading.ledger import GradeLedger
from proctor.server.sampling import SamplingService
from proctor.server.sources.base import SampleId
from proctor.server.store import GradeRow

__all__ = ["Rollouts"]


class Rollouts:
    def __init__(
        self, ctx: ServingContext, experience: ExperienceStore, sampling: SamplingService, ledger: GradeLedger
    ) -> None:
        self.ctx = ctx
        self.experience = experience
        self.sampling = sampling
        self.ledger = ledger
        self._changed = asyncio.Condition()
        self._version = 0

    async def open(self, iteration: int, slots: int, group_size: int) -> TableInfo:
        """Open the step's table; for a step this server sampled, fill the prompt's columns of every row."""
        served = await self.sampling.served(iteration)
        if served is not None and served.batch_size != slots:
            raise RequestError(
                f"iteration {iteration} was sampled with batch_size {served.batch_size}; open its table with "
                f"slots={served.batch_size} (one slot per prompt of the step, across all ranks)",
                status_code=409,
                code=ShapeConflictError.code,
            )
        x = self.experience
        info = await x.call(x.dock.open, iteration, slots=slots, group_size=group_size)
        if served is not None and info.written.get(col.SAMPLE_ID, 0) < info.rows:
            # Every rank opens the table; filling again writes the same values, which the store ignores.
            info = await x.call(_fill, x.dock, self.ctx.curriculum, served, group_size)
            await self._notify()
        return info

    async def put(self, iteration: int, body: dw.PutRequest) -> None:
        x = self.experience
        await x.call(_put, x.dock, iteration, body)
        await self._notify()

    async def write_completions(
        self, iteration: int, rows: Sequence[RowKey], texts: Sequence[str], tokens: Sequence[int | None]
    ) -> bool:
        """Write completions to rows of the step's table for the grader role; False (nothing written) when
        there is no table, a row is outside it, or a row holds another completion already."""
        x = self.experience
        try:
            await x.call(x.dock.put, iteration, rows, {col.COMPLETION: texts, col.COMPLETION_TOKENS: tokens})
        except RequestError as exc:
            if exc.code in (UnknownIterationError.code, DockInputError.code, CellConflictError.code):
                return False
            raise
        await self._notify()
        return True

    async def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Collected:
        """Collect a lease; the grader role's collections are stored and counted as grades."""
        x = self.experience
        collected = await x.call(x.dock.collect, lease, columns)
        await self._collected(collected, columns)
        return collected

    async def collect_wire(self, lease: str, body: dw.CollectRequest) -> Collected:
        """:meth:`collect` for a ``/dock`` request: its columns are decoded on the store's thread too."""
        x = self.experience
        collected, columns = await x.call(_collect, x.dock, lease, body)
        await self._collected(collected, columns)
        return collected

    async def _collected(self, collected: Collected, columns: Mapping[str, Sequence[Value]]) -> None:
        if collected.consumer == col.GRADER.name:
            await self._record_grades(collected, columns)
        await self._notify()

    @property
    def version(self) -> int:
        """Counts the writes and collections so far: what :meth:`wait_for_change` compares with."""
        return self._version

    async def wait_for_change(self, since: int, timeout_s: float) -> None:
        """Return once rows were written or collected after :attr:`version` was ``since``, or after
        ``timeout_s``."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self._version != since), timeout_s)

    async def rewards(self, iteration: int, rows: Sequence[RowKey], timeout_s: float) -> dict[str, list[Value]]:
        """The grader role's columns of ``rows`` once all are written; a 503 after ``timeout_s``."""
        x = self.experience
        deadline = time.monotonic() + timeout_s
        while True:
            since = self._version
            try:
                return await x.call(x.dock.read, iteration, rows, (col.REWARD, col.REWARD_DETAIL))
            except RequestError as exc:
                if exc.code != CellsMissingError.code:
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    workers = self.ctx.settings.grader_workers
                    hint = (
                        "this server has no grader processes (PROCTOR_GRADER_WORKERS=0): start "
                        "`proctor grade-worker --server URL`"
                        if workers == 0
                        else "the graders are busy or slow; raise PROCTOR_GRADER_TIMEOUT_S or add grade-workers"
                    )
                    raise UnavailableError(
                        f"the grader role did not grade {len(rows)} rows of iteration {iteration} within "
                        f"{timeout_s:g}s; {hint}"
                    ) from None
                await self.wait_for_change(since, left)

    async def _record_grades(self, collected: Collected, columns: Mapping[str, Sequence[Value]]) -> None:
        """Store and count the grades the grader role collected. Its reward columns are in ``columns``, unless
        a collection left them out (they were written before, or not at all: such rows have no grade)."""
        x = self.experience
        rewards = (col.REWARD, col.REWARD_DETAIL)
        names = (col.SAMPLE_ID, col.COMPLETION, *(c for c in rewards if c not in columns))
        read = await x.call(x.dock.read, collected.iteration, collected.rows, names, missing="none")
        values = {**read, **{c: columns[c] for c in rewards if c in columns}}
        stage = self.ctx.progress.stage_of(collected.iteration)
        grades: list[GradeRow] = []
        for n, (slot, index) in enumerate(collected.rows):
            sample_id, reward = values[col.SAMPLE_ID][n], values[col.REWARD][n]
            if sample_id is None or reward is None:
                continue
            sha = hashlib.sha256(str(values[col.COMPLETION][n]).encode()).hexdigest()
            components, error = col.parse_reward_detail(values[col.REWARD_DETAIL][n])
            key = (collected.iteration, str(sample_id), slot, index, sha)
            source = SampleId.parse(str(sample_id)).source
            grades.append(GradeRow(key, stage, source, float(reward), components, error))
        await self.ledger.record(grades)

    async def _notify(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()


def _collect(dock: TransferDock, lease: str, body: dw.CollectRequest) -> tuple[Collected, dict[str, list[Value]]]:
    columns = dw.columns_from_wire(body.columns)
    return dock.collect(lease, columns), columns


def _put(dock: TransferDock, iteration: int, body: dw.PutRequest) -> None:
    # Decoding the arrays is work that grows with the body: it runs on the store's thread too.
    dock.put(iteration, body.rows, dw.columns_from_wire(body.columns))


def _fill(dock: TransferDock, curriculum: Curriculum, served: ServedBatch, group_size: int) -> TableInfo:
    """Write the prompt's columns of every row of a sampled step (runs on the store's thread: it grows with the
    batch)."""
    per_slot: list[tuple[str, str, dict[str, Any]]] = []
    for sample_id in served.sample_ids:
        sid = SampleId.parse(sample_id)
        src = curriculum.sources.get(sid.source)
        if src is None or src.version != sid.version:
            # Its data or settings changed since the step was sampled: the record behind the key is another.
            stale = f"stale sample_id {sample_id!r}: its source changed since this step was sampled; not graded"
            per_slot.append((sample_id, "", {"answer": None, "metadata": {}, "stale": stale}))
            continue
        record = src.record(sid.key)
        per_slot.append((sample_id, record.prompt, {"answer": record.answer, "metadata": dict(record.metadata)}))
    every = [(slot, k) for slot in range(len(per_slot)) for k in range(group_size)]
    step = dock.limits.max_rows_per_call
    for start in range(0, len(every), step):
        rows = every[start : start + step]
        dock.put(
            served.iteration,
            rows,
            {
                col.SAMPLE_ID: [per_slot[slot][0] for slot, _ in rows],
                col.PROMPT: [per_slot[slot][1] for slot, _ in rows],
                col.REFERENCE: [per_slot[slot][2] for slot, _ in rows],
                col.STAGE: [served.stage_name] * len(rows),
            },
        )
    return dock.table(served.iteration)
