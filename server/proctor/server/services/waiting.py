"""What a request waits for on the event loop: a counter of events, and the rows of a table whose rewards a
``/grade`` waits for, handed to it by the collections that grade them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from proctor.experience import CellsMissingError, RowKey, Value
from proctor.server.exceptions import RequestError

__all__ = ["Awaited", "Signal", "when_delivered"]

T = TypeVar("T")

# How often a /grade waiting for its rewards reads them without being handed them: for rows graded before it
# waited, which no collection hands it.
_DELIVERY_LOOK_S = 0.25


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


class Awaited:
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


async def when_delivered(awaited: Awaited, wait_s: float, read: Callable[[], Awaitable[T]], *, read_first: bool) -> T:
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
