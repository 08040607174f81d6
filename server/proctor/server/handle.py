"""The dataserver the routes reach: serving, standing by for another server of the same PostgreSQL database, or
opening its state again after a failure.

A state that stops accepting writes leaves the server's memory possibly ahead of it (a commit whose outcome the
server never heard). A SQLite file's failure is its disk's, and the server answers 503 until it is restarted. A
PostgreSQL database's is usually an outage that passes (a restart, a failover): there the handle closes the
failed dataserver and opens it again from the database, as a restart of the process would, retrying until the
database answers. Every request gets a 503 that says so meanwhile, and no process exits.

Several servers may share one PostgreSQL database. The one that holds the database's lock serves; the others
stand by: they keep nothing of the run in memory, forward every request to the serving one
(:class:`~proctor.server.middleware.ForwardingMiddleware`) but the ``/grade`` requests they grade themselves
(:mod:`proctor.server.services.standby_grading`), and watch the lock. When the serving process ends, however
it ends, its connection ends with it and the lock is free: a standby opens the dataserver from the database,
as a restart would, and serves. See ``docs/deploying.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx

from proctor.server.dataserver import Dataserver
from proctor.server.exceptions import UnavailableError
from proctor.server.metrics import Metrics
from proctor.server.services.grading import GradingService
from proctor.server.services.standby_grading import Serving, StandbyGrading
from proctor.server.store import Standby, StateInUseError, StateMismatchError

__all__ = ["DataserverHandle", "Grading"]

log = logging.getLogger("proctor")

_SAY_EVERY_S = 60.0
_STARTING = "the dataserver is starting"
# A forwarded request waits for its answer as long as the serving server takes (a /grade waits for its
# graders); connecting to it is quick or the server is gone.
_FORWARD_TIMEOUT = httpx.Timeout(None, connect=2.0)

StartGrading = Callable[[Serving, Callable[[], None]], Awaitable[StandbyGrading]]
Grading = GradingService | StandbyGrading
"""What grades a ``/grade``: the serving dataserver's service, or a standby's."""


class DataserverHandle:
    """Create with :meth:`start`; ``open_server`` opens a dataserver from the state, and ``standby`` (for a
    PostgreSQL database) watches the database while another server holds it."""

    def __init__(
        self,
        open_server: Callable[[], Awaitable[Dataserver]],
        *,
        retry_s: float,
        standby: Callable[[], Standby] | None,
        metrics: Metrics,
        grading: StartGrading | None = None,
    ) -> None:
        self._metrics = metrics
        self._start_grading = grading
        self._grading: StandbyGrading | None = None
        self._grading_task: asyncio.Task[None] | None = None
        self._serving_token: str | None = None
        self._ending: asyncio.Task[None] | None = None
        self._server: Dataserver | None = None
        self._open = open_server
        self._retry_s = retry_s
        self._standby = standby
        self._failure: str | None = _STARTING
        self._serving_url: str | None = None  # the serving server's, while this one stands by
        self._acquiring: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._forwarder: httpx.AsyncClient | None = None

    @classmethod
    async def start(
        cls,
        open_server: Callable[[], Awaitable[Dataserver]],
        *,
        retry_s: float,
        standby: Callable[[], Standby] | None = None,
        metrics: Metrics,
        grading: StartGrading | None = None,
    ) -> DataserverHandle:
        """Open the dataserver; with ``standby``, stand by instead while another server holds the database
        (and with ``grading``, grade the ``/grade`` requests it can place meanwhile, see
        :mod:`proctor.server.services.standby_grading`). ``metrics``' ``proctor_serving`` follows which it does."""
        handle = cls(open_server, retry_s=retry_s, standby=standby, metrics=metrics, grading=grading)
        try:
            handle._serve(await open_server())
        except StateInUseError:
            if standby is None:
                raise
            log.info("another proctor serve holds the database: standing by, forwarding requests to it")
            handle._acquiring = asyncio.create_task(handle._acquire(None))
        return handle

    def get(self) -> Dataserver:
        """The serving dataserver; a 503 while there is none (starting, standing by, or opening again)."""
        if self._server is None:
            raise UnavailableError(self._failure or _STARTING)
        return self._server

    @property
    def serving(self) -> bool:
        return self._server is not None

    def grading(self) -> Grading:
        """What grades ``/grade`` here: this standby, while it grades; else the serving dataserver (a 503 while
        there is none)."""
        standby = self.standby_grading()
        return standby if standby is not None else self.get().grading

    def standby_grading(self) -> StandbyGrading | None:
        """What grades ``/grade`` requests on this standby, while it stands by for a known serving server; None
        while it serves, or when its requests go to the serving server whole."""
        return self._grading if self._serving_info() is not None else None

    def _serving_info(self) -> tuple[str, str] | None:
        if self._server is not None or self._failure is not None:
            return None
        if self._serving_url is None or self._serving_token is None:
            return None
        return self._serving_url, self._serving_token

    async def _begin_grading(self, start: StartGrading) -> None:
        try:
            self._grading = await start(self._serving_info, self.serving_unreachable)
        except Exception:
            log.warning("this standby could not start its grader processes: it forwards /grade too", exc_info=True)

    async def _end_grading(self) -> None:
        task, grading = self._grading_task, self._grading
        self._grading_task = self._grading = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if grading is not None:
            await grading.close()

    def forward_target(self) -> str | None:
        """Where this standby forwards requests: the serving server's URL; None while this one serves, or no
        server is known to serve."""
        if self._server is not None or self._failure is not None:
            return None
        return self._serving_url

    @property
    def forwarder(self) -> httpx.AsyncClient:
        """The client that forwards a standby's requests."""
        if self._forwarder is None:
            self._forwarder = httpx.AsyncClient(timeout=_FORWARD_TIMEOUT, follow_redirects=False)
        return self._forwarder

    def serving_unreachable(self) -> None:
        """A forwarded request found nobody at the serving URL: look at the lock now, not at the next poll."""
        self._wake.set()

    async def close(self) -> None:
        if self._acquiring is not None:
            self._acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acquiring
        await self._end_grading()
        if self._ending is not None:
            await self._ending
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self._forwarder is not None:
            await self._forwarder.aclose()

    def _serve(self, server: Dataserver) -> None:
        self._metrics.serving.set(1)
        self._server = server
        self._failure = None
        self._serving_url = None
        self._acquiring = None
        if self._grading_task is not None:
            # In-flight requests of the standby's grading end with it: their writes went to the server that
            # held the database, which is gone (clients retry).
            self._ending = asyncio.create_task(self._end_grading())
        storage = server.ctx.storage
        if storage.reopens:
            storage.on_failure = lambda: self._failed(server)

    def _failed(self, server: Dataserver) -> None:
        if self._server is not server or self._acquiring is not None:
            return
        self._failure = server.ctx.storage.failure
        self._server = None
        self._metrics.serving.set(0)
        self._acquiring = asyncio.create_task(self._acquire(server))

    async def _look(self, standby: Callable[[], Standby], watch: Standby | None) -> tuple[bool, Standby | None]:
        """Whether the database's lock is free, through ``watch`` (a new one when None or broken), and the watch
        to look through next time; meanwhile, who serves. A database of another curriculum stops this process
        (and raises :class:`StateMismatchError`)."""
        try:
            if watch is None:
                watch = await asyncio.to_thread(standby)
            holder = await asyncio.to_thread(watch.poll)
        except StateMismatchError as exc:
            # A server of another curriculum took the database first: this one must not serve it.
            log.critical("%s", exc)
            os.kill(os.getpid(), signal.SIGTERM)
            raise
        except Exception as exc:  # the database does not answer (StateUnreachableError, or its own)
            if watch is not None:
                with contextlib.suppress(Exception):
                    watch.close()
            if self._failure in (None, _STARTING):  # a failure's own message says more
                self._failure = f"the state database does not answer ({exc}); reconnecting"
            return False, None
        if not holder.free:
            if self._failure is not None or holder.serving_url != self._serving_url:
                log.info("standing by: %s serves the database", holder.serving_url or "a server")
            self._serving_url, self._serving_token, self._failure = holder.serving_url, holder.token, None
            if self._start_grading is not None and self._grading_task is None:
                self._grading_task = asyncio.create_task(self._begin_grading(self._start_grading))
        return holder.free, watch

    async def _acquire(self, failed: Dataserver | None) -> None:
        """Open the dataserver again once the database answers and its lock is free; meanwhile, stand by
        while another server holds it."""
        if failed is not None:
            try:
                await failed.close()
            except Exception:  # its connections are likely gone with the database: nothing more to release
                log.warning("closing the failed dataserver", exc_info=True)
        said = -math.inf
        watch: Standby | None = None
        try:
            while True:
                free = True
                if self._standby is not None:
                    free, watch = await self._look(self._standby, watch)
                if free:
                    try:
                        server = await self._open()
                    except StateInUseError:
                        pass  # another standby took it first
                    except Exception as exc:
                        self._failure = f"the state cannot be opened ({exc}); retrying"
                        if time.monotonic() - said >= _SAY_EVERY_S:  # once a minute at most, not once a try
                            said = time.monotonic()
                            log.warning("the state is still unavailable, retrying every %g s: %s", self._retry_s, exc)
                    else:
                        taken = "took over serving" if failed is None else "the state answers again: serving"
                        log.warning("%s (resumed after iteration %s)", taken, server.last_iteration)
                        self._serve(server)
                        return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._retry_s)
        except StateMismatchError:
            return  # the process is stopping
        finally:
            if watch is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(watch.close)
