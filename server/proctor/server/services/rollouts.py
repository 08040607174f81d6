"""The experience store as the dataserver uses it: the steps it sampled, the completions written to them, and
the grader role's rewards.

- ``/sample`` opens each step's table as it samples it, with the prompt's columns (``sample_id``, ``prompt``,
  ``reference``, ``stage``) written per slot, so every client's rollouts land in the store and a trainer
  writes only its completions.
- ``/grade`` writes its completions to their rows (:meth:`Rollouts.enqueue`); a completion that fills none of
  its step's slots goes to the step's table of loose completions (:func:`~proctor.experience.columns.loose_table`).
- A collection by the grader role (the dataserver's own pool or a remote ``proctor grade-worker``) is also a
  grade: it is stored in the state file with its record's statistics, in the transaction that writes the
  rewards, and counted in the curriculum's statistics (:class:`GradeLedger`), once per completion however
  often a row is re-dispatched or posted.
- Waiters are woken when rows are written (the local grader role) or collected; a ``/grade`` waiting for the
  role elsewhere is handed its rewards by the collections that grade its rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from proctor.experience import (
    CellsMissingError,
    Collected,
    ExperienceError,
    ExperienceInputError,
    ExperienceStore,
    RowKey,
    ShapeConflictError,
    TableInfo,
    UnknownIterationError,
    Value,
)
from proctor.experience import columns as col
from proctor.server.curriculum.loader import Curriculum
from proctor.server.exceptions import ConflictError, RequestError, UnavailableError
from proctor.server.services.batches import ServedBatch
from proctor.server.services.context import ServingContext
from proctor.server.services.experience import AsyncExperienceStore, refusal
from proctor.server.services.ledger import GradeLedger
from proctor.server.services.sampling import SamplingService
from proctor.server.sources.base import Record, SampleId
from proctor.server.state.rows import NO_SLOT, GradeKey, GradeRow, IterationRow, StoredGrades
from proctor.server.store import Store
from proctor.wire import dataserver as wire
from proctor.wire import experience as dw

__all__ = ["Completion", "Graded", "Recorded", "Rollouts", "Signal", "Written", "grade_key", "reference"]

T = TypeVar("T")

_OPENED = 4096  # steps remembered as opened, so a repeated /sample costs no store call
_RECOVER_ROWS = 4096
_SIGNALS = 1024  # tables whose collections /grade can wait for at once
_LOOK_S = 0.05
# How often a /grade waiting for its rewards reads them without being handed them: for rows graded before it
# waited, which no collection hands it.
_DELIVERY_LOOK_S = 0.25
# How often a waiting dispatch looks again without being woken: for rows that no write announces (those of a
# lease that expired).
_READY_LOOK_S = 0.25
_GRADES_PER_PART = 256  # grades counted in the curriculum's statistics between two turns of the event loop


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
class Written:
    """Where :meth:`Rollouts.write_graded` put each completion (``(table, slot, index)``, in the order given),
    which of those rows it collected the rewards of (the others another holder of the grader role held), and
    the grades a concurrent request had stored first, which are not counted again."""

    rows: list[tuple[int, int, int]]
    collected: set[tuple[int, int, int]]
    raced: set[GradeKey]


@dataclass(frozen=True, slots=True)
class _Stored:
    """What one transaction of graded completions wrote: :class:`Written`'s rows and collected rows for all its
    completions, and the grades it stored, in slices (see :class:`Recorded`)."""

    rows: list[tuple[int, int, int]]
    collected: set[tuple[int, int, int]]
    parts: list[tuple[list[GradeRow], StoredGrades]]


@dataclass(frozen=True, slots=True)
class _GradedWrite:
    """A :meth:`Rollouts.write_graded` call waiting for its transaction."""

    graded: Sequence[Graded]
    keys: set[GradeKey]  # the graded completions' grade keys
    lease_s: float
    done: asyncio.Future[Written]


class Rollouts:
    def __init__(
        self, ctx: ServingContext, experience: AsyncExperienceStore, sampling: SamplingService, ledger: GradeLedger
    ) -> None:
        self.ctx = ctx
        self.experience = experience
        self.sampling = sampling
        self.ledger = ledger
        self.written = Signal()
        """Rows were written: what this server's grader role waits for."""
        self.collected: dict[int, Signal] = {}
        """Per table, rows were collected: what ``/experience`` reads wait for."""
        self._awaited: dict[int, list[_Awaited]] = {}
        """Per table, the rows ``/grade`` requests wait for the rewards of; collections fill them."""
        self._opened: dict[int, None] = {}
        self._opening: dict[int, asyncio.Future[None]] = {}
        self._opener: asyncio.Task[None] | None = None
        # Per table of loose completions: the slots holding each (step, sample_id, step_slot). Used on the
        # store's thread only; rebuilt from the table after a restart.
        self._loose: dict[int, dict[tuple[int, str, int], list[int]]] = {}
        self._graded_writes: list[_GradedWrite] = []
        self._graded_writer: asyncio.Task[None] | None = None
        ctx.storage.join(_SampledTables(self))

    async def sample(self, req: wire.SampleRequest) -> bytes:
        """``/sample``: the batch, with its step's table opened in the store."""
        body = await self.sampling.sample(req)
        if req.iteration not in self._opened:
            await self._open_step(req.iteration)
        return body

    async def close(self) -> None:
        """Finish opening the steps sampled last, and writing the graded completions queued."""
        for task in (self._opener, self._graded_writer):
            if task is not None:
                with contextlib.suppress(Exception):
                    await task

    async def _open_step(self, iteration: int) -> None:
        """Open the table of a step sampled without it (by an earlier run, or refused when it was sampled; a
        new step's table is opened in the commit that records it). Steps asked for meanwhile are opened
        together, in one call of the store and one commit."""
        pending = self._opening.get(iteration)
        if pending is None:
            pending = self._opening[iteration] = asyncio.get_running_loop().create_future()
            pending.add_done_callback(_retrieved)
            if self._opener is None or self._opener.done():
                self._opener = asyncio.create_task(self._open_pending(), name="open-sampled-steps")
        await asyncio.shield(pending)

    async def _open_pending(self) -> None:
        x = self.experience
        while self._opening:
            opening, self._opening = self._opening, {}
            try:
                batches = [b for i in opening if (b := await self.sampling.served(i)) is not None]
                await x.call(_open_all_sampled, x.store, self.ctx.curriculum, [_Step.served(b) for b in batches])
            except BaseException as exc:
                for future in opening.values():
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for iteration, future in opening.items():
                self.opened(iteration)
                future.set_result(None)

    def opened(self, iteration: int) -> None:
        """Remember that the step's table is open: its next ``/sample`` costs no store call."""
        self._opened[iteration] = None
        while len(self._opened) > _OPENED:
            del self._opened[next(iter(self._opened))]

    async def record_refill(
        self,
        iteration: int,
        round_: int,
        detail: dict[str, Any],
        samples_json: str,
        new_ids: Sequence[str],
        replaced: Mapping[int, int],
    ) -> None:
        """Store a refill round of a step (see :meth:`Store.record_refill`) and mark the slots it replaced in the
        step's table (``replaced_by``: the slot that replaced each), in one transaction."""
        x = self.experience
        state = self.ctx.storage.store
        await x.call(_record_refill, state, x.store, iteration, round_, detail, samples_json, new_ids, replaced)

    async def open(self, iteration: int, slots: int, group_size: int | None) -> TableInfo:
        """Open the step's table; for a step this server sampled, its prompt's columns are written."""
        served = await self.sampling.served(iteration) if iteration >= 0 else None
        if served is not None and served.batch_size != slots:
            raise ConflictError(
                f"iteration {iteration} was sampled with batch_size {served.batch_size}; open its table with "
                f"slots={served.batch_size} (one slot per prompt of the step, across all ranks)",
                code=ShapeConflictError.code,
            )
        x = self.experience
        info = await x.call(x.store.open, iteration, slots=slots, group_size=group_size)
        if served is not None and col.SAMPLE_ID not in info.written:
            # A step sampled before its table could be opened (by a server without the store, say).
            info = await x.call(_open_sampled, x.store, self.ctx.curriculum, _Step.served(served))
            await self.written.notify()
        return info

    async def put(self, iteration: int, body: dw.PutRequest) -> None:
        x = self.experience
        await x.call(_put, x.store, iteration, body)
        await self.written.notify()

    async def enqueue(self, completions: Sequence[Completion]) -> list[tuple[int, int, int]]:
        """Write completions to their rows (a step's slot, or the step's loose completions), for the grader
        role elsewhere (remote grade-workers, which poll); returns each one's ``(table, slot, index)``."""
        x = self.experience
        placed = await x.call(_enqueue, x.store, self._loose, completions, self._stage_names(completions))
        await self.written.notify()  # a grade-worker waiting in a dispatch takes them at once
        return placed

    async def write_graded(self, graded: Sequence[Graded], *, lease_s: float) -> Written:
        """Write completions the caller graded, with their rewards and grades, in one store call and one
        transaction: each to its row, leased to the caller as the grader role and collected at once (so that
        the role elsewhere never takes it), the grades stored and folded into the records' statistics. A row
        another holder of the role had leased first is left to it (see :meth:`rewards`).

        Calls made while the store's thread writes are queued, and the next transaction writes those whose
        completions are distinct together. When the store refuses such a transaction (a completion index
        beyond its group, a cell written before with another value), each of its calls is written again on its
        own, so that only the call at fault fails and nothing of it is kept."""
        done: asyncio.Future[Written] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)
        self._graded_writes.append(_GradedWrite(graded, {g.grade.key for g in graded}, lease_s, done))
        if self._graded_writer is None or self._graded_writer.done():
            self._graded_writer = asyncio.create_task(self._write_queued(), name="write-graded")
        # A cancelled request leaves its completions to be written: the transaction may have begun already.
        return await asyncio.shield(done)

    async def _write_queued(self) -> None:
        while self._graded_writes:
            group: list[_GradedWrite] = []
            later: list[_GradedWrite] = []
            keys: set[GradeKey] = set()
            for call in self._graded_writes:
                if group and (call.keys & keys or call.lease_s != group[0].lease_s):
                    later.append(call)  # a repeat of a queued completion is written after it, and finds it stored
                    continue
                group.append(call)
                keys |= call.keys
            self._graded_writes = later
            try:
                await self._write_together(group)
            except BaseException as exc:  # cancelled: nothing waits for the rest either
                for call in (*group, *self._graded_writes):
                    if not call.done.done():
                        call.done.set_exception(exc)
                self._graded_writes = []
                raise

    async def _write_together(self, group: Sequence[_GradedWrite]) -> None:
        x = self.experience
        graded = [g for call in group for g in call.graded]
        names = self._stage_names([g.completion for g in graded])
        try:
            stored = await x.call(_write_graded, x.store, x.state, self._loose, graded, names, group[0].lease_s)
        except Exception as exc:
            if len(group) == 1:
                group[0].done.set_exception(exc)
                return
            for call in group:
                await self._write_together([call])
            return
        await self._count(stored.parts)
        if self._awaited:
            # Rows of a table that another /grade waits for (the same completions posted twice at once).
            for (table, slot, index), g in zip(stored.rows, graded, strict=True):
                if table in self._awaited and (table, slot, index) in stored.collected:
                    self._deliver(table, [(slot, index)], [g.reward], [g.detail])
        for table in sorted({table for table, _, _ in stored.collected}):
            await self._signal(table).notify()
        raced = {
            row.key
            for rows, grades in stored.parts
            for row, outcome in zip(rows, grades.outcomes, strict=True)
            if outcome == "exists"
        }
        start = 0
        for call in group:
            rows = stored.rows[start : start + len(call.graded)]
            start += len(call.graded)
            call.done.set_result(Written(rows, {r for r in rows if r in stored.collected}, raced & call.keys))

    def _stage_names(self, completions: Sequence[Completion]) -> dict[int, str]:
        stages = {c.step: self.ctx.progress.stage_of(c.step) for c in completions}
        return {step: self.ctx.curriculum.stages[stage].name for step, stage in stages.items()}

    async def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Recorded:
        """Collect a lease. A collection by the grader role is also a grade: stored in the state file (read from
        the rows' cells), with its record's statistics, in the transaction that writes the rewards, and counted
        once however often the rows are re-dispatched or posted."""
        x = self.experience
        recorded = await x.call(_collect_and_record, x.store, x.state, lease, columns, self._stage_of)
        await self._counted(recorded)
        return recorded

    async def collect_wire(
        self, lease: str, body: dw.CollectRequest, then: Callable[[ExperienceStore, str], T] | None = None
    ) -> tuple[Collected, T | None]:
        """:meth:`collect` for a ``/experience`` request: its columns are decoded on the store's thread too.
        With ``then``, that is called there next, with the consumer's name, in the collection's transaction: a
        worker's next dispatch, one store call and one commit with its collection. When ``then`` refuses (an
        :class:`ExperienceError`, raised before it writes anything), the collection is stored all the same and
        the refusal raised after."""
        x = self.experience
        recorded, after = await x.call(_collect_wire, x.store, x.state, lease, body, self._stage_of, then)
        await self._counted(recorded)
        if isinstance(after, ExperienceError):
            raise refusal(after) from after
        return recorded.collected, after

    def _stage_of(self, step: int) -> int:
        # Read on the store's thread, beside the event loop: a sampled step's stage is fixed once it is sampled
        # (the schedule only grows past the latest step), and StageSchedule.apply appends each transition before
        # its iteration, so a read between the two sees a consistent prefix.
        return self.ctx.progress.stage_of(step)

    async def _counted(self, recorded: Recorded) -> None:
        """Count the grades a collection stored, and wake its table's waiters."""
        await self._count(recorded.parts)
        collected = recorded.collected
        if recorded.rewards is not None:
            self._deliver(collected.iteration, collected.rows, *recorded.rewards)
        await self._signal(collected.iteration).notify()

    def _deliver(self, table: int, rows: Sequence[RowKey], rewards: Sequence[Value], details: Sequence[Value]) -> None:
        """Hand collected rewards to the ``/grade`` requests waiting for those rows."""
        for awaited in self._awaited.get(table, ()):
            awaited.fill(rows, rewards, details)

    async def _count(self, parts: Sequence[tuple[list[GradeRow], StoredGrades]]) -> None:
        """Count stored grades in the curriculum's statistics, a slice at a time."""
        for part, stored in parts:
            self.ledger.count(part, stored)
            await asyncio.sleep(0)

    def _signal(self, table: int) -> Signal:
        signal = self.collected.get(table)
        if signal is None:
            signal = self.collected[table] = Signal()
            if len(self.collected) > _SIGNALS:  # the oldest tables' waiters still wake, by their timeout
                del self.collected[next(iter(self.collected))]
        return signal

    async def rewards(
        self, table: int, rows: Sequence[RowKey], timeout_s: float, *, written_now: bool = False
    ) -> dict[str, list[Value]]:
        """The grader role's columns of ``rows`` once all are written. A 503 when no grader role has claimed
        them within the claim timeout, or they are not graded within ``timeout_s``.

        Collections hand their rewards to the waiting request as they are recorded. The rows' cells are read at
        once, for rows graded already, unless the caller has ``written_now`` (it wrote them just before: only
        a later collection grades them); and again each time a look's time passes without all delivered."""
        x = self.experience
        awaited = _Awaited(rows)
        waiting = self._awaited.setdefault(table, [])
        waiting.append(awaited)

        async def read() -> dict[str, list[Value]]:
            if awaited.complete:
                return {col.REWARD: awaited.rewards, col.REWARD_DETAIL: awaited.details}
            return await x.call(x.store.read, table, rows, (col.REWARD, col.REWARD_DETAIL))

        s = self.ctx.settings
        start = time.monotonic()
        try:
            try:
                return await _when_delivered(awaited, s.grader_claim_timeout_s, read, read_first=not written_now)
            except RequestError as exc:
                if exc.code != CellsMissingError.code:
                    raise
            if not await x.call(x.store.claimed, col.GRADER.name, table, rows):
                raise UnavailableError(
                    f"no grader claimed the {len(rows)} completions of table {table} within "
                    f"{s.grader_claim_timeout_s:g}s (PROCTOR_GRADER_CLAIM_TIMEOUT_S): "
                    + (
                        "this server has no grader processes (PROCTOR_GRADER_WORKERS=0); start one with "
                        "`proctor grade-worker --server URL`"
                        if s.grader_workers == 0
                        else "its graders are busy; add `proctor grade-worker --server URL` processes"
                    )
                    + ". They stay queued: post them again to get their rewards"
                )
            try:
                left = max(0.0, timeout_s - (time.monotonic() - start))
                return await _when_delivered(awaited, left, read, read_first=False)
            except RequestError as exc:
                if exc.code != CellsMissingError.code:
                    raise
            raise UnavailableError(
                f"the grader role did not grade {len(rows)} completions of table {table} within {timeout_s:g}s; "
                "the graders are busy or slow: raise PROCTOR_GRADER_TIMEOUT_S or add grade-workers, and post them "
                "again to get their rewards"
            )
        finally:
            waiting.remove(awaited)
            if not waiting:
                del self._awaited[table]

    async def renew(self, lease: str, lease_s: float) -> float:
        """Extend a lease of the grader role's (or any consumer's)."""
        x = self.experience
        return await x.call(x.store.renew, lease, lease_s)

    async def recover(self) -> None:
        """Store and count every grade the store holds that the state file lacks (a state file written by a
        server that stored them apart). Storing is idempotent, so the grades stored already count once still."""
        x = self.experience
        for info in await x.call(x.store.tables):
            if not info.written.get(col.REWARD):
                continue
            rows = [(s, k) for s in range(info.slots) for k in range(info.width)]
            for start in range(0, len(rows), _RECOVER_ROWS):
                part = Collected(col.GRADER.name, info.iteration, tuple(rows[start : start + _RECOVER_ROWS]))
                await self._counted(await x.call(_record, x.store, x.state, part, {}, self._stage_of))

    async def when_ready(self, wait_s: float, dispatch: Callable[[], Awaitable[tuple[bool, T]]]) -> tuple[bool, T]:
        """``dispatch()`` (which says whether it found no row, and its answer) again until it finds rows or
        ``wait_s`` passed: a long poll, woken by the writes that make rows ready. Its last outcome."""
        deadline = time.monotonic() + wait_s
        while True:
            since = self.written.version
            empty, answer = await dispatch()
            left = deadline - time.monotonic()
            if not empty or left <= 0:
                return empty, answer
            await self.written.wait(since, min(left, _READY_LOOK_S))

    async def when_written(self, table: int, wait_s: float, read: Callable[[], Awaitable[T]]) -> T:
        """``read()`` once it no longer fails for cells not yet written, or its failure after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            signal = self._signal(table)
            since = signal.version
            try:
                return await read()
            except RequestError as exc:
                left = deadline - time.monotonic()
                if exc.code != CellsMissingError.code or left <= 0:
                    raise
            # Collections wake it at once; other writes are seen at the next look.
            await signal.wait(since, min(left, _LOOK_S))


class Signal:
    """A counter of events and a way to wait for the next one."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self.version = 0

    async def notify(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def wait(self, since: int, timeout_s: float) -> None:
        """Return once :attr:`version` is past ``since``, or after ``timeout_s``."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != since), timeout_s)


class _Awaited:
    """Rows of one table whose rewards a ``/grade`` waits for, filled as collections are recorded."""

    def __init__(self, rows: Sequence[RowKey]) -> None:
        self.at: dict[RowKey, list[int]] = {}
        for n, row in enumerate(rows):
            self.at.setdefault(row, []).append(n)
        self.rewards: list[Value] = [None] * len(rows)
        self.details: list[Value] = [None] * len(rows)
        self.filled = asyncio.Event()
        if not self.at:
            self.filled.set()

    @property
    def complete(self) -> bool:
        return not self.at

    def fill(self, rows: Sequence[RowKey], rewards: Sequence[Value], details: Sequence[Value]) -> None:
        for row, reward, detail in zip(rows, rewards, details, strict=True):
            if reward is None:
                continue  # collected without a reward: not graded, and read as such
            for n in self.at.pop(row, ()):
                self.rewards[n], self.details[n] = reward, detail
        if not self.at:
            self.filled.set()


async def _when_delivered(awaited: _Awaited, wait_s: float, read: Callable[[], Awaitable[T]], *, read_first: bool) -> T:
    """``read()`` once the rows are delivered or, each time a look's time passes without, once it no longer
    fails for cells not yet written (at once too, with ``read_first``); its failure after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    wait = not read_first
    while True:
        if wait:
            left = deadline - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(awaited.filled.wait(), max(0.0, min(left, _DELIVERY_LOOK_S)))
        wait = True
        try:
            return await read()
        except RequestError as exc:
            if exc.code != CellsMissingError.code or deadline - time.monotonic() <= 0:
                raise


@dataclass(frozen=True, slots=True)
class Recorded:
    """A collection and the grades it stored, in slices of at most a few hundred (each with its outcomes),
    for the curriculum's statistics to count a slice at a time."""

    collected: Collected
    parts: list[tuple[list[GradeRow], StoredGrades]]
    rewards: tuple[Sequence[Value], Sequence[Value]] | None = None
    """The grader role's ``reward`` and ``reward_detail`` of the collected rows, in their order (None for
    another consumer's collection)."""


def _collect_and_record(
    experience: ExperienceStore,
    state: Store,
    lease: str,
    columns: Mapping[str, Sequence[Value]],
    stage_of: Callable[[int], int],
) -> Recorded:
    """The collection and, for the grader role's, its grades: one transaction."""
    with experience.batch():
        collected = experience.collect(lease, columns)
        if collected.consumer != col.GRADER.name:
            return Recorded(collected, [])
        return _record(experience, state, collected, columns, stage_of)


def _collect_wire(
    experience: ExperienceStore,
    state: Store,
    lease: str,
    body: dw.CollectRequest,
    stage_of: Callable[[int], int],
    then: Callable[[ExperienceStore, str], T] | None,
) -> tuple[Recorded, T | ExperienceError | None]:
    with experience.batch():
        recorded = _collect_and_record(experience, state, lease, dw.columns_from_wire(body.columns), stage_of)
        if then is None:
            return recorded, None
        try:
            return recorded, then(experience, recorded.collected.consumer)
        except ExperienceError as exc:  # refused before writing: the collection commits without it
            return recorded, exc


def _record(
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
        return Recorded(collected, _store_grades(state, grades), (values[col.REWARD], values[col.REWARD_DETAIL]))


def _store_grades(state: Store, grades: Sequence[GradeRow]) -> list[tuple[list[GradeRow], StoredGrades]]:
    parts = [list(grades[start : start + _GRADES_PER_PART]) for start in range(0, len(grades), _GRADES_PER_PART)]
    return [(part, state.insert_grades(part)) for part in parts]


def grade_key(step: int, sample_id: str, step_slot: int | None, index: int, completion: str) -> GradeKey:
    """What makes a grade the same grade: see :data:`proctor.server.state.rows.GradeKey`."""
    sha = hashlib.sha256(completion.encode()).hexdigest()
    slot = NO_SLOT if step_slot is None or step_slot < 0 else step_slot
    return (step, sample_id, slot, index, sha)


def _put(experience: ExperienceStore, iteration: int, body: dw.PutRequest) -> None:
    # Decoding the arrays is work that grows with the body: it runs on the store's thread too.
    experience.put(iteration, body.rows, dw.columns_from_wire(body.columns))


def reference(record: Record) -> dict[str, Any]:
    """A record's ``reference`` cell: what its graders check a completion against."""
    return {"answer": record.answer, "metadata": dict(record.metadata)}


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: its waiter may have gone (a cancelled request)."""
    if not future.cancelled():
        future.exception()


def _open_all_sampled(experience: ExperienceStore, curriculum: Curriculum, steps: Sequence[_Step]) -> None:
    """Open the tables of sampled steps in one commit; a step older than every table kept is left without."""
    with experience.batch():
        for step in steps:
            with contextlib.suppress(UnknownIterationError):
                _open_sampled(experience, curriculum, step)


class _SampledTables:
    """Opens each new step's table in the transaction that records the step (:meth:`AsyncStore.join`): a step
    is on disk with its table, or not at all, and ``/sample`` waits for one commit, not two."""

    def __init__(self, rollouts: Rollouts) -> None:
        self._rollouts = rollouts
        self._refused: set[int] = set()  # written on the store's thread, read on the loop after the commit

    def transaction(self) -> AbstractContextManager[None]:
        return self._rollouts.experience.store.batch()

    def recorded(self, rows: Sequence[IterationRow]) -> None:
        experience, curriculum = self._rollouts.experience.store, self._rollouts.ctx.curriculum
        for row in rows:
            try:
                _open_sampled(experience, curriculum, _Step.recorded(row, curriculum))
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
                self._rollouts.opened(row.iteration)


def _record_refill(
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
class _Step:
    """What opening a sampled step's table needs of its batch."""

    iteration: int
    batch_size: int
    sample_ids: Sequence[str]
    stage_name: str

    @classmethod
    def served(cls, batch: ServedBatch) -> _Step:
        # The batch's own slots: those its refill rounds added hold loose completions.
        return cls(batch.iteration, batch.batch_size, batch.sample_ids[: batch.batch_size], batch.stage_name)

    @classmethod
    def recorded(cls, row: IterationRow, curriculum: Curriculum) -> _Step:
        ids = [str(s["sample_id"]) for s in row.samples[: row.batch_size]]
        return cls(row.iteration, row.batch_size, ids, curriculum.stages[row.stage].name)


def _open_sampled(experience: ExperienceStore, curriculum: Curriculum, served: _Step) -> TableInfo:
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


def _enqueue(
    experience: ExperienceStore,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    completions: Sequence[Completion],
    stage_names: Mapping[int, str],
) -> list[tuple[int, int, int]]:
    """:meth:`Rollouts.enqueue` on the store's thread: every call of the store's runs there one at a time, so
    what this reads is still so when it writes. The request is checked first (a refused one writes nothing),
    then its writes are one commit."""
    _check_indices(experience, completions)
    try:
        with experience.batch():
            return _place(experience, loose_slots, completions, stage_names)
    except BaseException:
        loose_slots.clear()  # slots the batch added were rolled back with it: read the tables again
        raise


def _write_graded(
    experience: ExperienceStore,
    state: Store,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    graded: Sequence[Graded],
    stage_names: Mapping[int, str],
    lease_s: float,
) -> _Stored:
    """:meth:`Rollouts.write_graded` on the store's thread: the completions placed, their rows leased to the
    grader role and collected with their rewards, their grades stored, in one transaction."""
    completions = [g.completion for g in graded]
    _check_indices(experience, completions)
    try:
        with experience.batch():
            rows = _place(experience, loose_slots, completions, stage_names)
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
            return _Stored(rows, collected, _store_grades(state, grades))
    except BaseException:
        loose_slots.clear()  # slots the batch added were rolled back with it: read the tables again
        raise


def _check_indices(experience: ExperienceStore, completions: Sequence[Completion]) -> None:
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


def _place(
    experience: ExperienceStore,
    loose_slots: dict[int, dict[tuple[int, str, int], list[int]]],
    completions: Sequence[Completion],
    stage_names: Mapping[int, str],
) -> list[tuple[int, int, int]]:
    """Write each completion to its row, ``(table, slot, index)``: its step's slot, or a loose one."""
    placed: list[tuple[int, int, int] | None] = [None] * len(completions)
    loose: list[int] = []
    by_step: dict[int, list[int]] = {}
    for n, c in enumerate(completions):
        if c.step_slot is not None and experience.has(c.step) and c.step_slot < experience.table(c.step).slots:
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
            _write_completions(experience, step, [key for _, key in new], [completions[n] for n, _ in new])
    for n, where in zip(
        loose, _place_loose(experience, loose_slots, [completions[n] for n in loose], stage_names), strict=True
    ):
        placed[n] = where
    return [p for p in placed if p is not None]


def _write_completions(
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


def _place_loose(
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
            _write_completions(experience, table, [placed[n] for n in write], [completions[n] for n in write])
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
