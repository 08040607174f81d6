"""The experience store (:class:`~proctor.dock.TransferDock`) behind the dataserver's ``/dock`` routes.

The store keeps its tables in the server's state file, on a connection of its own, and every call runs on a
thread of its own, one at a time: a call's work grows with its rows (encoding, SQLite), and none of it may
hold the event loop. The store's errors become answers with their status and ``code``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from proctor.dock import DockError, TransferDock
from proctor.server.exceptions import RequestError
from proctor.server.settings import Settings

__all__ = ["ExperienceStore"]

P = ParamSpec("P")
T = TypeVar("T")


class ExperienceStore:
    """Create with :meth:`open`, release with :meth:`close`; ``await store.call(TransferDock.put, …)``."""

    def __init__(self, dock: TransferDock, thread: ThreadPoolExecutor) -> None:
        self.dock = dock
        self._thread = thread

    @classmethod
    async def open(cls, settings: Settings, path: str) -> ExperienceStore:
        """The store's tables in the state file at ``path``."""
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proctor-dock")
        try:
            dock = await asyncio.get_running_loop().run_in_executor(
                thread,
                lambda: TransferDock(
                    path, keep_iterations=settings.dock_keep_iterations, synchronous=settings.state_sync
                ),
            )
        except BaseException:
            thread.shutdown()
            raise
        return cls(dock, thread)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.dock.close)
        self._thread.shutdown(wait=True)

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the store's thread; a :class:`DockError` becomes a :class:`RequestError`."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))
        except DockError as exc:
            raise RequestError(exc.message, status_code=exc.status, code=exc.code) from exc
