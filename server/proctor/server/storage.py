"""The state file as the event loop uses it: :class:`AsyncStore` decides where each store call runs, commits
new iterations in groups, keeps the WAL short, and stops the server from serving once a write has failed.

Where calls run. Every write runs on the store's one thread, in order: the experience store's
(:class:`~proctor.server.services.experience.AsyncExperienceStore`) too, on the same connection, so that a call can make
both in one transaction (a grade, its record's statistics and the store's cells). A request's look-ups
(indexed reads, tens of microseconds) run inline on the event loop, through a connection of their own that
reads the last commit, so they never wait for a write; an in-memory state file has one connection only, and
reads on the thread too. Start-up reads (full scans) run on the thread, and checkpoints on a thread and
connection of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

from proctor.experience.database import error_line
from proctor.server.exceptions import UnavailableError
from proctor.server.settings import Settings
from proctor.server.state.items import GroupState, ItemState, ItemTracking
from proctor.server.state.rows import GradeKey, GradeRow, IterationRow, IterationTotals, StageTotals, TransitionRecord
from proctor.server.store import Store

__all__ = ["AsyncStore", "IterationsJoiner", "StoredProgress"]

log = logging.getLogger("proctor")

P = ParamSpec("P")
T = TypeVar("T")

_CHECKPOINT_EVERY_S = 0.5
_WATCH_EVERY_S = 1.0
# A new iteration waiting for its group commit, with the future its requests wait on.
_Queued = tuple[IterationRow, Sequence[TransitionRecord], str, "asyncio.Future[None]"]
_WAL_RESTART_FRAMES = 8192  # 32 MiB of 4 KiB pages


@dataclass(frozen=True, slots=True)
class StoredProgress:
    """What a previous run of this state file left: enough to carry on where it stopped."""

    transitions: list[TransitionRecord]
    decided_through: int | None
    last_iteration: int | None
    totals: dict[int, StageTotals]
    recent_rewards: dict[int, list[float]]  # per stage, oldest first
    items: dict[str, list[tuple[int, float, float, int, int, int]]]  # per finite source, see Store.item_rows
    sampler_state: dict[str, Any] | None  # after the latest iteration an adaptive stage decided
    iterations: list[IterationTotals]  # the latest iterations, for the live page
    recent_errors: list[tuple[int, str, str]]
    # For learning-progress mixes (empty without one): the latest iterations' decisions, (sampler, detail) by
    # iteration, and the latest graded groups, oldest first.
    decisions: dict[int, tuple[str, dict[str, Any]]]
    groups: list[tuple[int, str, int, GroupState]]
    refills: dict[int, tuple[int, int]]  # the latest iterations' refill rounds and groups replaced


class IterationsJoiner(Protocol):
    """Another store's writes made in the transaction of each group commit of new iterations (the experience
    store's tables of the sampled steps)."""

    def transaction(self) -> AbstractContextManager[None]:
        """The transaction, on the shared connection, that the group commit runs in (on the store's thread)."""

    def recorded(self, rows: Sequence[IterationRow]) -> None:
        """The other store's writes for ``rows``, inside :meth:`transaction` (on the store's thread)."""

    def committed(self, rows: Sequence[IterationRow]) -> None:
        """On the event loop, once the transaction is committed, before any request waiting for it goes on."""


class AsyncStore:
    """Create with :meth:`open`, release with :meth:`close`."""

    def __init__(self, store: Store, thread: ThreadPoolExecutor) -> None:
        self._store = store
        self.thread = thread
        """The thread every write runs on (the experience store's too)."""
        self._inline = store.concurrent_reads
        self.failure: str | None = None
        self._checkpoints: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._queued: list[_Queued] = []
        self._idle = asyncio.Event()  # set while no group commit is queued or running
        self._idle.set()
        self._joiner: IterationsJoiner | None = None
        self.on_failure: Callable[[], None] | None = None
        """Called once, on the event loop, when the state stops accepting writes (see :meth:`fail`)."""

    def join(self, joiner: IterationsJoiner) -> None:
        """Make ``joiner``'s writes part of every group commit of new iterations, from now on."""
        self._joiner = joiner

    @classmethod
    async def open(
        cls,
        settings: Settings,
        *,
        curriculum: str,
        curriculum_hash: str,
        seed: int,
        tracking: ItemTracking,
        adopt: Callable[[Store], None] | None = None,
    ) -> AsyncStore:
        """Open (or create) the state of the curriculum named ``curriculum`` (with that content hash and seed),
        folding grades into the records ``tracking`` names; ``adopt`` then runs on the store's thread (another
        run's stage history, for one)."""
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proctor-store")
        loop = asyncio.get_running_loop()
        path = settings.state_path(curriculum, curriculum_hash)
        store = await loop.run_in_executor(thread, lambda: Store(path, synchronous=settings.state_sync))
        try:
            await loop.run_in_executor(
                thread, lambda: store.bind(curriculum=curriculum, curriculum_hash=curriculum_hash, seed=seed)
            )
            store.track_items(tracking)
            if adopt is not None:
                await loop.run_in_executor(thread, adopt, store)
        except BaseException:
            await loop.run_in_executor(thread, store.close)
            thread.shutdown()
            raise
        wrapper = cls(store, thread)
        # A state file's WAL is kept short; a PostgreSQL database has no WAL of ours, and is asked after instead.
        if wrapper.reopens:
            wrapper._watch = asyncio.create_task(wrapper._watch_forever())
        else:
            wrapper._checkpoints = asyncio.create_task(wrapper._checkpoint_forever())
        return wrapper

    @property
    def path(self) -> str:
        """The state file (or ``:memory:``), or the PostgreSQL database's URL without its password."""
        return self._store.display

    @property
    def store(self) -> Store:
        """The store itself, for calls made on :attr:`thread` (see :meth:`write`)."""
        return self._store

    async def write(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the store's thread, where every write runs; a failure of the state file
        stops the server (:meth:`fail`) and is a 503."""
        try:
            return await self._on_thread(fn, *args, **kwargs)
        except self._store.connection.errors as exc:
            raise UnavailableError(self.fail(exc)) from exc

    async def close(self) -> None:
        for task in (self._checkpoints, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._idle.wait()  # let a group commit in progress finish
        await self._on_thread(self._store.close)
        self.thread.shutdown(wait=True)

    async def _checkpoint_forever(self) -> None:
        """Keep the WAL short, on a thread of its own so that writes never wait for the copying."""
        while True:
            await asyncio.sleep(_CHECKPOINT_EVERY_S)
            try:
                await asyncio.to_thread(self._store.checkpoint, restart_after_frames=_WAL_RESTART_FRAMES)
            except Exception:  # a busy or failing checkpoint is retried; writes report their own failures
                log.exception("WAL checkpoint failed")

    async def _watch_forever(self) -> None:
        """Ask a PostgreSQL database every second whether the connection holds. A server that no request writes
        through would otherwise go on answering from memory after losing its connection (and with it the
        database's lock, which a standby then takes), until its next write failed."""
        while self.failure is None:
            await asyncio.sleep(_WATCH_EVERY_S)
            try:
                await self.write(self._store.ping)
            except UnavailableError:
                return  # write() stopped the server; the handle opens the database again

    # --- failure ------------------------------------------------------------------------------------------

    @property
    def reopens(self) -> bool:
        """Whether the server opens its state again by itself once it fails (a PostgreSQL database: an outage
        there passes, a full disk under a state file does not)."""
        return self._store.connection.dialect == "postgresql"

    def fail(self, exc: BaseException) -> str:
        """Stop serving: the state refused a write (or a read), so memory may have run ahead of it. Returns
        the reason."""
        if self.failure is None:
            then = "reconnecting" if self.reopens else "restart the server"
            self.failure = f"{self._store.described} stopped accepting writes ({error_line(exc)}); {then}"
            log.critical("%s", self.failure)
            if self.on_failure is not None:
                asyncio.get_running_loop().call_soon(self.on_failure)
        return self.failure

    def check_healthy(self) -> None:
        """Raise :class:`UnavailableError` (503) once a write has failed."""
        if self.failure is not None:
            raise UnavailableError(self.failure)

    # --- where calls run ----------------------------------------------------------------------------------

    async def _on_thread(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.thread, lambda: fn(*args, **kwargs))

    async def _read(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            if self._inline:
                return fn(*args, **kwargs)
            return await self._on_thread(fn, *args, **kwargs)
        except self._store.connection.errors as exc:
            raise UnavailableError(self.fail(exc)) from exc

    # --- reads --------------------------------------------------------------------------------------------

    async def stored_progress(
        self,
        stages: int,
        window: Callable[[int], int],
        finite: Iterable[str],
        timeline: tuple[int, int],
        groups: int = 0,
    ) -> StoredProgress:
        """Everything :class:`StoredProgress` holds; ``window(stage)`` is how many recent rewards to read,
        ``timeline`` how many of the latest iterations and grader errors, and ``groups`` how many of the latest
        graded groups the learning-progress mixes read back (0: there is none, and their decisions are not read
        either)."""
        s = self._store
        last = await self._on_thread(s.last_iteration)
        iterations, errors = timeline
        first = 0 if last is None else max(0, last - iterations + 1)
        decision = await self._on_thread(s.last_decision)
        return StoredProgress(
            transitions=await self._on_thread(s.transitions),
            decided_through=await self._on_thread(s.decided_through),
            last_iteration=last,
            totals=await self._on_thread(s.stage_totals),
            recent_rewards={i: await self._on_thread(s.recent_rewards, i, window(i)) for i in range(stages)},
            items={source: await self._on_thread(s.item_rows, source) for source in finite},
            sampler_state=None if decision is None else decision[1],
            iterations=await self._on_thread(s.iteration_totals, first),
            recent_errors=await self._on_thread(s.recent_errors, errors),
            decisions=await self._on_thread(s.decision_details, first) if groups > 0 else {},
            groups=await self._on_thread(s.latest_groups, groups) if groups > 0 else [],
            refills=await self._on_thread(s.refill_counts, first),
        )

    async def get_iteration(self, iteration: int) -> IterationRow | None:
        return await self._read(self._store.get_iteration, iteration)

    async def latest_served(self, sample_ids: Iterable[str]) -> dict[str, int]:
        return await self._read(self._store.latest_served, sample_ids)

    async def graded_iterations(self, iterations: Iterable[int]) -> set[int]:
        return await self._read(self._store.graded_iterations, iterations)

    async def find_grades(self, keys: Iterable[GradeKey]) -> dict[GradeKey, GradeRow]:
        return await self._read(self._store.find_grades, keys)

    async def step_groups(self, iteration: int, limit: int) -> list[tuple[str, int, GroupState]]:
        return await self._read(self._store.step_groups, iteration, limit)

    async def slot_rewards(self, iteration: int, slots: Sequence[int]) -> dict[int, dict[int, float | None]]:
        return await self._read(self._store.slot_rewards, iteration, slots)

    async def refills(self, iteration: int) -> list[tuple[int, dict[str, Any]]]:
        return await self._read(self._store.refills, iteration)

    async def records(self, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], ItemState]:
        return await self._read(self._store.records, keys)

    # --- writes -------------------------------------------------------------------------------------------

    def record_iteration(
        self, row: IterationRow, transitions: Sequence[TransitionRecord], samples_json: str
    ) -> asyncio.Future[None]:
        """Queue a new iteration for the next group commit; the future is done once it is on disk.

        The iterations decided in one turn of the event loop (requests that arrived together) are committed
        in one transaction, on the store's thread; those decided while a commit runs go in the one after.
        Commits stay in decision order. Should a commit fail, every future of its group fails with
        :class:`UnavailableError` and the server stops serving (:meth:`fail`).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queued.append((row, transitions, samples_json, done))
        if self._idle.is_set():
            self._idle.clear()
            loop.call_soon(self._start_commit)
        return done

    def _start_commit(self) -> None:
        group, self._queued = self._queued, []
        entries = [(row, transitions, samples_json) for row, transitions, samples_json, _ in group]
        task = asyncio.ensure_future(self._on_thread(self._record_iterations, entries, self._joiner))
        task.add_done_callback(
            lambda t: self._committed(group, asyncio.CancelledError() if t.cancelled() else t.exception())
        )

    def _record_iterations(
        self, entries: Sequence[tuple[IterationRow, Sequence[TransitionRecord], str]], joiner: IterationsJoiner | None
    ) -> None:
        if joiner is None:
            self._store.record_iterations(entries)
            return
        with joiner.transaction():
            self._store.record_iterations(entries)
            joiner.recorded([row for row, _, _ in entries])

    def _committed(self, group: list[_Queued], exc: BaseException | None) -> None:
        # A failed commit is a 503 for every request waiting on it, as a failed grade write is.
        error = None if exc is None else UnavailableError(self.fail(exc))
        if error is not None:
            error.__cause__ = exc
        elif self._joiner is not None:
            self._joiner.committed([row for row, *_ in group])
        for *_, done in group:
            if done.cancelled():
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        if self._queued:
            asyncio.get_running_loop().call_soon(self._start_commit)
        else:
            self._idle.set()
