"""The dataserver the routes reach, and its reopening when its PostgreSQL database fails.

A state that stops accepting writes leaves the server's memory possibly ahead of it (a commit whose outcome the
server never heard). A SQLite file's failure is its disk's, and the server answers 503 until it is restarted. A
PostgreSQL database's is usually an outage that passes (a restart, a failover): there the handle closes the
failed dataserver and opens it again from the database, as a restart of the process would, retrying until the
database answers. Every request gets a 503 that says so meanwhile, and no process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from proctor.server.dataserver import Dataserver
from proctor.server.exceptions import UnavailableError

__all__ = ["DataserverHandle"]

log = logging.getLogger("proctor")

_SAY_EVERY_S = 60.0


class DataserverHandle:
    """Holds the serving :class:`Dataserver`; ``open_server`` opens a new one from the state."""

    def __init__(self, server: Dataserver, open_server: Callable[[], Awaitable[Dataserver]], retry_s: float) -> None:
        self._server: Dataserver | None = server
        self._open = open_server
        self._retry_s = retry_s
        self._failure: str | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._watch(server)

    def get(self) -> Dataserver:
        """The serving dataserver; a 503 while it is being opened again."""
        if self._server is None:
            raise UnavailableError(self._failure or "the dataserver is starting")
        return self._server

    async def close(self) -> None:
        if self._reopening is not None:
            self._reopening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reopening
        if self._server is not None:
            await self._server.close()
            self._server = None

    def _watch(self, server: Dataserver) -> None:
        storage = server.ctx.storage
        if storage.reopens:
            storage.on_failure = lambda: self._failed(server)

    def _failed(self, server: Dataserver) -> None:
        if self._server is not server or self._reopening is not None:
            return
        self._failure = server.ctx.storage.failure
        self._server = None
        self._reopening = asyncio.create_task(self._reopen(server))

    async def _reopen(self, failed: Dataserver) -> None:
        try:
            await failed.close()
        except Exception:  # its connections are likely gone with the database: nothing more to release
            log.warning("closing the failed dataserver", exc_info=True)
        said = -math.inf
        while True:
            await asyncio.sleep(self._retry_s)
            try:
                server = await self._open()
                break
            except Exception as exc:
                if time.monotonic() - said >= _SAY_EVERY_S:  # once a minute at most, not once a try
                    said = time.monotonic()
                    log.warning("the state is still unavailable, retrying every %g s: %s", self._retry_s, exc)
        log.warning("the state answers again: serving (resumed after iteration %s)", server.last_iteration)
        self._failure = None
        self._server = server
        self._reopening = None
        self._watch(server)
