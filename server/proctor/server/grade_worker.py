"""A grader role anywhere: a pool of grader processes that takes rows from a dataserver's experience store and
writes their rewards back (``proctor grade-worker``).

It works through any face of the store (:class:`proctor.experience.loop.ExperienceLike`); the dataserver counts
each grade it collects once in the curriculum's statistics. A worker that dies holds its rows only until its lease ends;
a result for a lease that ended is refused by the store and dropped here. While the server is unreachable
(a restart), the worker waits and tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from pydantic import SecretStr

from proctor.experience import Dispatch, LeaseError
from proctor.experience import columns as col
from proctor.experience.loop import ExperienceLike
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import JudgeGrader, LocalGrader, RemoteGrader, SourceGraders
from proctor.server.metrics import Metrics
from proctor.server.services.grade_rows import grade_rows
from proctor.server.services.grader_role import LEASE_S, ROWS_PER_DISPATCH, renewing
from proctor.wire import dataserver as wire

__all__ = ["GradeWorker", "WorkerStats", "source_graders"]

log = logging.getLogger("proctor.grade_worker")

# A dispatch waits this long at the server for a ready row (a long poll): an idle worker asks every few seconds,
# and a busy one gets new rows the moment they are written.
DISPATCH_WAIT_S = 5.0
# A dispatch takes rows of up to this many tables (each step's, each /grade's outside a step), each under a lease
# of its own: one request, and one grading batch, for the rows of several /grade requests.
TABLES_PER_DISPATCH = 8
_RECONNECT_S = 1.0


def source_graders(spec: wire.Graders) -> dict[str, SourceGraders]:
    """The graders of each source, from a dataserver's ``GET /graders``."""
    if spec.headers_withheld:
        for name, s in spec.sources.items():
            for g in s.remote:
                if g.headers:
                    raise ValueError(
                        f"source {name!r} has a remote grader {g.key!r} with headers, which the server withholds "
                        "because it has no API key; start it with PROCTOR_API_KEY and give the worker the key"
                    )
    return {
        name: SourceGraders(
            local=tuple(LocalGrader(g.key, g.ref, g.params, g.weight, g.multiplicative) for g in s.local),
            remote=tuple(
                RemoteGrader(g.key, g.url, g.timeout_s, g.headers, g.params, g.weight, g.multiplicative)
                for g in s.remote
            ),
            on_error=s.on_error,
            names=tuple(s.names),
            judges=tuple(JudgeGrader(**g.model_dump()) for g in s.judges),
        )
        for name, s in spec.sources.items()
    }


@dataclass
class WorkerStats:
    """What a worker did: rows graded and collected, results refused (their lease had ended), and how often
    the server could not be reached."""

    graded: int = 0
    refused: int = 0
    unreachable: int = 0


class GradeWorker:
    """``await worker.run()`` grades rows until ``stop`` is set (then it grades and collects the rows it holds,
    and takes no more), or, with ``idle_exit_s``, until no row came for that long."""

    def __init__(
        self,
        experience: ExperienceLike,
        graders: Mapping[str, SourceGraders],
        pool: GraderPool,
        http: httpx.AsyncClient,
        *,
        timeout_s: float,
        rows_per_dispatch: int = ROWS_PER_DISPATCH,
        tables_per_dispatch: int = TABLES_PER_DISPATCH,
        lease_s: float = LEASE_S,
        transient: tuple[type[BaseException], ...] = (),
        judge_api_key: SecretStr | None = None,
    ) -> None:
        self.experience = experience
        self.graders = graders
        self.fanout = GraderFanout(pool, http, Metrics(), timeout_s, judge_api_key=judge_api_key)
        self.rows_per_dispatch = rows_per_dispatch
        self.tables_per_dispatch = tables_per_dispatch
        self.lease_s = lease_s
        self.transient = transient
        self.stats = WorkerStats()

    async def run(self, stop: asyncio.Event | None = None, *, idle_exit_s: float | None = None) -> WorkerStats:
        try:
            return await self._grade(stop or asyncio.Event(), idle_exit_s)
        finally:
            await self.fanout.aclose()  # the judges' connections

    async def _grade(self, stop: asyncio.Event, idle_exit_s: float | None) -> WorkerStats:
        wait_s = DISPATCH_WAIT_S if idle_exit_s is None else min(DISPATCH_WAIT_S, idle_exit_s)
        last_work = time.monotonic()
        held: tuple[Dispatch, ...] = ()  # rows held: those a collection's answer brought, graded even when stopping
        while True:
            if not held:
                if stop.is_set() or (idle_exit_s is not None and time.monotonic() - last_work > idle_exit_s):
                    break
                try:
                    held = await asyncio.to_thread(
                        self.experience.dispatch_many,
                        col.GRADER.name,
                        self.rows_per_dispatch,
                        tables=self.tables_per_dispatch,
                        lease_s=self.lease_s,
                        wait_s=wait_s,
                    )
                except self.transient as exc:
                    self.stats.unreachable += 1
                    log.warning("the dataserver is unreachable (%s); trying again in %gs", exc, _RECONNECT_S)
                    await _sleep(stop, _RECONNECT_S)
                    continue
                if not held:
                    continue  # the dispatch waited for a row already
            held = await self._collect(held, await self._graded(held), stop, wait_s)
            last_work = time.monotonic()
        return self.stats

    async def _graded(self, held: tuple[Dispatch, ...]) -> list[tuple[str, dict[str, list[object]]]]:
        """Each lease's rewards: the rows of every table held, graded together (each lease renewed meanwhile)."""
        needs = held[0].columns.keys()
        rows = {name: [v for d in held for v in d.columns[name]] for name in needs}
        async with contextlib.AsyncExitStack() as leases:
            for d in held:
                assert d.lease is not None
                await leases.enter_async_context(renewing(self._renew, d.lease, self.lease_s))
            columns = await grade_rows(self.fanout, self.graders, rows)
        results: list[tuple[str, dict[str, list[object]]]] = []
        start = 0
        for d in held:
            assert d.lease is not None
            results.append((d.lease, {name: list(values[start : start + len(d)]) for name, values in columns.items()}))
            start += len(d)
        return results

    async def _collect(
        self,
        held: tuple[Dispatch, ...],
        results: list[tuple[str, dict[str, list[object]]]],
        stop: asyncio.Event,
        wait_s: float,
    ) -> tuple[Dispatch, ...]:
        """Collect the rewards of the leases ``held`` and, unless the worker is stopping, dispatch its next rows in
        the same request: those rows (none when stopping)."""
        while True:
            try:
                if stop.is_set():  # finish what it holds, take nothing new
                    outcomes = await asyncio.to_thread(self.experience.collect_many, col.GRADER.name, results)
                    batch: tuple[Dispatch, ...] = ()
                else:
                    outcomes, batch = await asyncio.to_thread(
                        self.experience.collect_and_dispatch_many,
                        col.GRADER.name,
                        results,
                        self.rows_per_dispatch,
                        tables=self.tables_per_dispatch,
                        lease_s=self.lease_s,
                        wait_s=wait_s,
                    )
            except self.transient as exc:
                self.stats.unreachable += 1
                if stop.is_set():
                    rows = sum(len(d) for d in held)
                    log.warning(
                        "stopping with the dataserver unreachable (%s): %d rows go back at their lease's end", exc, rows
                    )
                    return ()
                # The server is restarting: its leases survive the restart, so the results are still wanted (and
                # collecting them again, if the first attempt was stored, writes nothing twice).
                log.warning("the dataserver is unreachable (%s); collecting again in %gs", exc, _RECONNECT_S)
                await _sleep(stop, _RECONNECT_S)
                continue
            for dispatch, outcome in zip(held, outcomes, strict=True):
                if isinstance(outcome, LeaseError):
                    # Its rows went back to the pool and are graded by whoever holds them now.
                    self.stats.refused += 1
                    log.warning("dropped the rewards of %d rows: %s", len(dispatch), outcome)
                else:
                    self.stats.graded += len(outcome.rows)
            return batch

    async def _renew(self, lease: str, lease_s: float) -> float:
        return await asyncio.to_thread(self.experience.renew, lease, lease_s)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
