"""The dataserver's own grader role: its pool of grader processes as one consumer of the experience store.

Two loops take turns: while one grades a dispatch, the other can already claim the next rows. A loop sleeps
until rows are written (or a second passes, for leases of dead remote workers that expire meanwhile). A writer
that waits for its rewards (``put_and_read``) does not wait for the loops: its own rows are claimed with its
write and graded at once (:meth:`GraderRole.grade_written`).

Every grader role, here or in a ``proctor grade-worker``, holds its rows under a short lease that it renews
while it grades (:func:`renewing`): a holder that dies, or a server restarted under it, gives the rows back
within one lease, however long grading takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from proctor.experience import (
    CellConflictError,
    Dispatch,
    ExperienceError,
    LeaseError,
    UnknownIterationError,
    Value,
)
from proctor.experience import columns as col
from proctor.server.exceptions import RequestError
from proctor.server.grading.fanout import GraderFanout
from proctor.server.services.grade_rows import grade_rows
from proctor.server.services.rollouts import Rollouts
from proctor.wire import experience as dw

__all__ = ["LEASE_S", "GraderRole", "grade_lease", "grading_time", "renewing"]

log = logging.getLogger("proctor.grading")

T = TypeVar("T")
_Cells = dict[str, list[bytes | None]]  # stored cells, by column

ROWS_PER_DISPATCH = 256
LEASE_S = 30.0
_LOOPS = 2
_IDLE_S = 1.0


def grading_time(rows: int, processes: int, timeout_s: float) -> float:
    """The longest ``rows`` may take on ``processes`` graders that each take up to ``timeout_s``, plus slack."""
    return math.ceil(rows / max(processes, 1)) * timeout_s + 30.0


@contextlib.asynccontextmanager
async def renewing(renew: Callable[[str, float], Awaitable[float]], lease: str, lease_s: float) -> AsyncIterator[None]:
    """Renew ``lease`` every third of ``lease_s`` while the body runs; a renewal refused (the lease ended
    already) stops the renewals, and the body's result will be refused at its collection."""

    async def keep() -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                await renew(lease, lease_s)
            except (RequestError, ExperienceError) as exc:
                log.warning("stopped renewing lease %s…: %s", lease[:8], exc)
                return
            except Exception as exc:  # unreachable server: the next renewal may get through
                log.warning("could not renew lease %s…: %s", lease[:8], exc)

    task = asyncio.create_task(keep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def grade_lease(rollouts: Rollouts, fanout: GraderFanout, batch: Dispatch, lease_s: float) -> None:
    """The grader role's work for one lease: grade its rows (renewing the lease meanwhile) and collect their
    rewards, stored as grades (read from the rows' cells) in the same transaction."""
    await _grade(rollouts, fanout, batch, lease_s, rollouts.collect)


async def _grade(
    rollouts: Rollouts,
    fanout: GraderFanout,
    batch: Dispatch,
    lease_s: float,
    collect: Callable[[str, Mapping[str, Sequence[Value]]], Awaitable[T]],
) -> T | None:
    """:func:`grade_lease`, its collection made by ``collect``: its outcome, None when the lease had ended."""
    assert batch.lease is not None
    async with renewing(rollouts.renew, batch.lease, lease_s):
        columns = await grade_rows(fanout, rollouts.ctx.curriculum.graders, batch.columns)
    try:
        return await collect(batch.lease, columns)
    except RequestError as exc:
        if exc.code not in (LeaseError.code, UnknownIterationError.code, CellConflictError.code):
            raise
        # The lease ended under a very slow batch (its rows went back to the pool, for another holder), retention
        # dropped its table, or a writer wrote a reward of its own into a row while the role held it (the store
        # hands out no row whose reward is written, so only that race gets here): the store keeps nothing of
        # this result.
        log.warning("the rewards of a dispatch of table %s were not kept: %s", batch.iteration, exc)
        return None


class GraderRole:
    """Start with :meth:`start`, stop with :meth:`close`."""

    def __init__(self, rollouts: Rollouts, fanout: GraderFanout, lease_s: float = LEASE_S) -> None:
        self.rollouts = rollouts
        self.fanout = fanout
        self.lease_s = lease_s
        self._tasks: list[asyncio.Task[None]] = []
        self._grading: set[asyncio.Task[_Cells | None]] = set()  # the rows of writers that wait for their rewards
        self._stopping = False

    async def grade_written(self, iteration: int, body: dw.PutRequest) -> _Cells | None:
        """A write whose writer waits for what the role makes of its rows (``body.read``): the rows claimed by
        this role in the write's store call, graded at once rather than when one of the role's loops next
        looks, and the ``read`` cells read in the collection's store call. Those cells (None where not written:
        rows another holder of the role holds), or None when this role claimed none of the rows. A writer that
        goes away meanwhile leaves its rows to be graded all the same."""
        batch = await self.rollouts.put_and_claim(iteration, body, lease_s=self.lease_s)
        if batch.lease is None:
            return None  # graded already, or held by another holder of the role: the writer's read waits for them

        def collect(lease: str, columns: Mapping[str, Sequence[Value]]) -> Awaitable[_Cells]:
            return self.rollouts.collect_and_read(lease, columns, body.rows, body.read)

        task = asyncio.create_task(_grade(self.rollouts, self.fanout, batch, self.lease_s, collect))
        self._grading.add(task)
        task.add_done_callback(self._graded)
        return await asyncio.shield(task)

    def _graded(self, task: asyncio.Task[_Cells | None]) -> None:
        self._grading.discard(task)
        if not task.cancelled() and task.exception() is not None:  # seen here too, should the writer be gone
            log.warning("grading a writer's rows failed; they go back to the pool: %s", task.exception())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name=f"grader-role-{n}") for n in range(_LOOPS)]

    async def close(self) -> None:
        # A cancellation that lands as a wait ends can be lost (asyncio.wait_for); the flag ends the loop anyway.
        self._stopping = True
        grading = tuple(self._grading)
        for task in (*self._tasks, *grading):
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # A writer's rows left ungraded go back to the pool when their lease ends, as any holder's do.
        await asyncio.gather(*grading, return_exceptions=True)

    async def _run(self) -> None:
        x = self.rollouts.experience
        while not self._stopping:
            try:
                since = self.rollouts.written.version
                batch = await x.call(x.store.dispatch, col.GRADER.name, ROWS_PER_DISPATCH, lease_s=self.lease_s)
                if batch.lease is None:
                    await self.rollouts.written.wait(since, _IDLE_S)
                    continue
                await grade_lease(self.rollouts, self.fanout, batch, self.lease_s)
            except (RequestError, ExperienceError) as exc:
                # A lease that expired under a very slow batch, or a store that failed: the rows go back to
                # the pool (or the server is stopping); try again shortly rather than end the role.
                log.warning("the grader role could not finish a dispatch: %s", exc)
                await asyncio.sleep(_IDLE_S)
            except Exception:
                # A role that ended here would leave every later completion ungraded: log it and go on.
                log.exception("the grader role failed on a dispatch; its rows go back to the pool")
                await asyncio.sleep(_IDLE_S)
