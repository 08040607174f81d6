"""The experience store as the dataserver uses it: the steps it sampled, the completions written to them, and
the grader role's rewards.

- ``/sample`` opens each step's table as it samples it, with the prompt's columns (``sample_id``, ``prompt``,
  ``reference``, ``stage``) written per slot, so every client's rollouts land in the store and a trainer
  writes only its completions.
- ``/grade`` writes its completions to their rows (:meth:`Rollouts.enqueue`; :mod:`.placement`); a completion
  that fills none of its step's slots goes to the step's table of loose completions.
- A collection by the grader role (the dataserver's own pool or a remote ``proctor grade-worker``) is also a
  grade (:mod:`.recording`): it is stored in the state file with its record's statistics, in the transaction
  that writes the rewards, and counted in the curriculum's statistics (:class:`GradeLedger`), once per
  completion however often a row is re-dispatched or posted.
- Waiters are woken when rows are written (the local grader role) or collected; a ``/grade`` waiting for the
  role elsewhere is handed its rewards by the collections that grade its rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from proctor.experience import (
    CellsMissingError,
    Collected,
    Dispatch,
    ExperienceError,
    ExperienceStore,
    LeaseError,
    RowKey,
    ShapeConflictError,
    TableInfo,
    Value,
)
from proctor.experience import columns as col
from proctor.server.exceptions import ConflictError, RequestError, UnavailableError
from proctor.server.services import placement, recording, sampled_tables
from proctor.server.services.context import ServingContext
from proctor.server.services.experience import AsyncExperienceStore, refusal
from proctor.server.services.ledger import GradeLedger
from proctor.server.services.placement import Completion, Graded
from proctor.server.services.recording import Recorded
from proctor.server.services.sampling import SamplingService
from proctor.server.services.waiting import Awaited, Signal, when_delivered
from proctor.server.state.rows import GradeKey, GradeRow, StoredGrades
from proctor.server.store import Store
from proctor.wire import dataserver as wire
from proctor.wire import experience as dw

__all__ = ["Rollouts", "Written"]

T = TypeVar("T")

_OPENED = 4096  # steps remembered as opened, so a repeated /sample costs no store call
_RECOVER_ROWS = 4096
_SIGNALS = 1024  # tables whose collections /experience reads can wait for at once
_LOOK_S = 0.05  # how often a waiting /experience read looks again without being woken
# How often a waiting dispatch looks again without being woken: for rows that no write announces (those of a
# lease that expired).
_READY_LOOK_S = 0.25


@dataclass(frozen=True, slots=True)
class Written:
    """Where :meth:`Rollouts.write_graded` put each completion (``(table, slot, index)``, in the order given),
    which of those rows it collected the rewards of (the others another holder of the grader role held), and
    the grades a concurrent request had stored first, which are not counted again."""

    rows: list[tuple[int, int, int]]
    collected: set[tuple[int, int, int]]
    raced: set[GradeKey]


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
        self._awaited: dict[int, list[Awaited]] = {}
        """Per table, the rows ``/grade`` requests wait for the rewards of; collections fill them."""
        self._opened: dict[int, None] = {}
        self._opening: dict[int, asyncio.Future[None]] = {}
        self._opener: asyncio.Task[None] | None = None
        # Per table of loose completions: the slots holding each (step, sample_id, step_slot). Used on the
        # store's thread only; rebuilt from the table after a restart.
        self._loose: dict[int, dict[tuple[int, str, int], list[int]]] = {}
        self._graded_writes: list[_GradedWrite] = []
        self._graded_writer: asyncio.Task[None] | None = None
        ctx.storage.join(sampled_tables.SampledTables(experience.store, ctx.curriculum, self.opened))

    @property
    def last_iteration(self) -> int | None:
        return self.ctx.progress.last_iteration

    def stage_of(self, iteration: int) -> int:
        return self.ctx.progress.stage_of(iteration)

    async def sample_ids(self, iteration: int) -> tuple[str, ...] | None:
        """The sample id in each slot of ``iteration``; None if it was never sampled."""
        return await self.sampling.sample_ids(iteration)

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
                await x.call(
                    sampled_tables.open_all_sampled,
                    x.store,
                    self.ctx.curriculum,
                    [sampled_tables.SampledStep.served(b) for b in batches],
                )
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
        await x.call(
            sampled_tables.record_refill, state, x.store, iteration, round_, detail, samples_json, new_ids, replaced
        )

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
            info = await x.call(
                sampled_tables.open_sampled, x.store, self.ctx.curriculum, sampled_tables.SampledStep.served(served)
            )
            await self.written.notify()
        return info

    async def put(self, iteration: int, body: dw.PutRequest) -> None:
        x = self.experience
        await x.call(_put, x.store, iteration, body)
        await self.written.notify()

    async def put_and_claim(self, iteration: int, body: dw.PutRequest, *, lease_s: float) -> Dispatch:
        """:meth:`put`, and in the same store call and transaction, those of its rows that are ready for the
        grader role leased to the caller as the role (with the columns it grades from)."""
        x = self.experience
        batch = await x.call(_put_and_claim, x.store, iteration, body, lease_s)
        await self.written.notify()
        return batch

    async def enqueue(self, completions: Sequence[Completion]) -> list[tuple[int, int, int]]:
        """Write completions to their rows (a step's slot, or the step's loose completions), for the grader
        role elsewhere (remote grade-workers, which poll); returns each one's ``(table, slot, index)``."""
        x = self.experience
        placed = await x.call(placement.enqueue, x.store, self._loose, completions, self._stage_names(completions))
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
            stored = await x.call(
                placement.write_graded, x.store, x.state, self._loose, graded, names, group[0].lease_s
            )
        except Exception as exc:
            if len(group) == 1:
                group[0].done.set_exception(exc)
                return
            for call in group:
                await self._write_together([call])
            return
        await self._count(stored.parts)
        by_table: dict[int, tuple[list[RowKey], list[Value], list[Value]]] = {
            table: ([], [], []) for table, _, _ in stored.collected
        }
        if self._awaited:  # rows that another /grade waits for (the same completions posted twice at once)
            for (table, slot, index), g in zip(stored.rows, graded, strict=True):
                if table in self._awaited and (table, slot, index) in stored.collected:
                    keys, rewards, details = by_table[table]
                    keys.append((slot, index))
                    rewards.append(g.reward)
                    details.append(g.detail)
        for table, (keys, rewards, details) in sorted(by_table.items()):
            await self._collected(table, keys, rewards, details)
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
        recorded = await x.call(recording.collect_and_record, x.store, x.state, lease, columns, self._stage_of)
        await self._counted(recorded)
        return recorded

    async def collect_and_read(
        self, lease: str, columns: Mapping[str, Sequence[Value]], rows: Sequence[RowKey], names: Sequence[str]
    ) -> dict[str, list[bytes | None]]:
        """:meth:`collect`, then, in the same store call, the stored bytes of the cells ``names`` of ``rows`` in
        the lease's table (None where not written): what a writer that waits for its rewards reads."""
        x = self.experience
        recorded, cells = await x.call(_collect_and_read, x.store, x.state, lease, columns, self._stage_of, rows, names)
        await self._counted(recorded)
        return cells

    async def collect_wire(
        self, lease: str, body: dw.CollectRequest, then: Callable[[ExperienceStore, str], T] | None = None
    ) -> tuple[Collected, T | None]:
        """:meth:`collect` for a ``/experience`` request: its columns are decoded on the store's thread too.
        With ``then``, that is called there next, with the consumer's name, in the collection's transaction: a
        worker's next dispatch, one store call and one commit with its collection. When ``then`` refuses (an
        :class:`ExperienceError`, raised before it writes anything), the collection is stored all the same and
        the refusal raised after."""
        x = self.experience
        recorded, after = await x.call(recording.collect_wire, x.store, x.state, lease, body, self._stage_of, then)
        await self._counted(recorded)
        if isinstance(after, ExperienceError):
            raise refusal(after) from after
        return recorded.collected, after

    async def collect_many_wire(
        self,
        consumer: str,
        body: dw.CollectManyRequest,
        then: Callable[[ExperienceStore, str], T] | None = None,
    ) -> tuple[list[Collected | LeaseError], T | None]:
        """:meth:`collect_wire` for several of ``consumer``'s leases, in one store call and one commit; a lease
        the store refuses is answered with its :class:`LeaseError` in its place."""
        x = self.experience
        outcomes, after = await x.call(
            recording.collect_many_wire, x.store, x.state, consumer, body, self._stage_of, then
        )
        for o in outcomes:
            if isinstance(o, Recorded):
                await self._counted(o)
        if isinstance(after, ExperienceError):
            raise refusal(after) from after
        return [o if isinstance(o, LeaseError) else o.collected for o in outcomes], after

    def _stage_of(self, step: int) -> int:
        # Read on the store's thread, beside the event loop: a sampled step's stage is fixed once it is sampled
        # (the schedule only grows past the latest step), and StageSchedule.apply appends each transition before
        # its iteration, so a read between the two sees a consistent prefix.
        return self.ctx.progress.stage_of(step)

    async def _counted(self, recorded: Recorded) -> None:
        """Count the grades a collection stored, and tell its table's waiters."""
        await self._count(recorded.parts)
        collected = recorded.collected
        if recorded.rewards is None:  # another consumer's collection: no rewards to hand
            await self._collected(collected.iteration, (), (), ())
        else:
            await self._collected(collected.iteration, collected.rows, *recorded.rewards)

    async def _collected(
        self, table: int, rows: Sequence[RowKey], rewards: Sequence[Value], details: Sequence[Value]
    ) -> None:
        """Rows of ``table`` were collected: hand the grader role's rewards of ``rows`` to the ``/grade`` requests
        waiting for them, and wake the table's ``/experience`` readers."""
        for awaited in self._awaited.get(table, ()):
            awaited.fill(rows, rewards, details)
        await self._signal(table).notify()

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
        awaited = Awaited(rows)
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
                return await when_delivered(awaited, s.grader_claim_timeout_s, read, read_first=not written_now)
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
                return await when_delivered(awaited, left, read, read_first=False)
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
                await self._counted(await x.call(recording.record, x.store, x.state, part, {}, self._stage_of))

    async def when_ready(
        self, wait_s: float, dispatch: Callable[[], Awaitable[tuple[bool, T]]], *, since: int | None = None
    ) -> tuple[bool, T]:
        """``dispatch()`` (which says whether it found no row, and its answer) again until it finds rows or
        ``wait_s`` passed: a long poll, woken by the writes that make rows ready. Its last outcome. With ``since``
        (:attr:`written`'s version before a look the caller made, which found no row), the first look waits for
        a write after it, or a look's time."""
        deadline = time.monotonic() + wait_s
        while True:
            if since is not None:
                await self.written.wait(since, max(0.0, min(deadline - time.monotonic(), _READY_LOOK_S)))
            since = self.written.version
            empty, answer = await dispatch()
            if not empty or deadline - time.monotonic() <= 0:
                return empty, answer

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


def _put(experience: ExperienceStore, iteration: int, body: dw.PutRequest) -> None:
    # Decoding the arrays is work that grows with the body: it runs on the store's thread too.
    experience.put(iteration, body.rows, dw.columns_from_wire(body.columns))


def _put_and_claim(experience: ExperienceStore, iteration: int, body: dw.PutRequest, lease_s: float) -> Dispatch:
    with experience.batch():
        _put(experience, iteration, body)
        return experience.claim(col.GRADER.name, iteration, body.rows, lease_s=lease_s)


def _collect_and_read(
    experience: ExperienceStore,
    state: Store,
    lease: str,
    columns: Mapping[str, Sequence[Value]],
    stage_of: Callable[[int], int],
    rows: Sequence[RowKey],
    names: Sequence[str],
) -> tuple[Recorded, dict[str, list[bytes | None]]]:
    with experience.batch():
        recorded = recording.collect_and_record(experience, state, lease, columns, stage_of)
        return recorded, experience.read_cells(recorded.collected.iteration, rows, names, missing="none")


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen: its waiter may have gone (a cancelled request)."""
    if not future.cancelled():
        future.exception()
