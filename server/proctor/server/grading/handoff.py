"""A few interchangeable things (grader processes, a judge's connections) lent out in order of who waits.

``asyncio.Queue`` is not fair to its waiters: a ``put`` wakes the first one, but a ``get`` that runs before it
does takes the item, and the woken waiter then queues again at the back. Under load, whoever asks at the right
moment goes first, and some waiters wait behind many that came after them. :class:`HandOff` gives a freed item
straight to the first waiter instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterable
from typing import Generic, TypeVar

__all__ = ["HandOff"]

T = TypeVar("T")


class HandOff(Generic[T]):
    """Items lent to waiters by priority (a lower number first), then in the order they asked.

    Free items are a stack: with few waiters, the same few items serve them all (a warm process, an open
    connection)."""

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._free: list[T] = list(items)
        self._waiters: list[tuple[int, int, asyncio.Future[T]]] = []
        self._order = itertools.count()

    def put(self, item: T) -> None:
        """Give ``item`` back: to the first waiter, if any."""
        while self._waiters:
            _, _, waiter = heapq.heappop(self._waiters)
            if not waiter.done():  # one cancelled while it waited is skipped
                waiter.set_result(item)
                return
        self._free.append(item)

    async def get(self, priority: int = 0) -> T:
        """An item, once every waiter before this one (by priority, then arrival) has had one."""
        if self._free:  # nobody waits while an item is free
            return self._free.pop()
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put(waiter.result())  # handed over as this waiter was cancelled: pass it on
            raise

    def wanted_before(self, priority: int) -> bool:
        """Whether someone of a lower ``priority`` waits: a holder of that priority should give its item back
        rather than keep it for more of its own work."""
        while self._waiters and self._waiters[0][2].done():
            heapq.heappop(self._waiters)
        return bool(self._waiters) and self._waiters[0][0] < priority
