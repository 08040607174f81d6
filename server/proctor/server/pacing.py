"""Per-item work on the event loop that hands the loop back every few milliseconds, whatever its size."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

__all__ = ["PACE_S", "paced"]

T = TypeVar("T")

# A request needs several turns of the loop to be answered, so the turns are short: no request holds the
# loop for long, whatever its size.
PACE_S = 0.002


async def paced(items: Iterable[T]) -> AsyncIterator[T]:
    """``items``, handing the event loop back whenever ``PACE_S`` has passed since it last had it."""
    turn = time.perf_counter()
    for item in items:
        yield item
        if time.perf_counter() - turn > PACE_S:
            await asyncio.sleep(0)
            turn = time.perf_counter()
