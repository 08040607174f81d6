"""HandOff: a freed item goes to the first waiter, by priority and then arrival, never to a newcomer."""

from __future__ import annotations

import asyncio

import pytest

from proctor.server.grading.handoff import HandOff
from tests.server.grading.conftest import settle

pytestmark = pytest.mark.anyio


async def test_a_freed_item_goes_to_the_first_waiter_not_to_one_that_asks_as_it_is_freed() -> None:
    # The newcomer's first step is scheduled before the put wakes the waiter: asyncio.Queue would give it the
    # item, and the waiter, finding none, would queue again behind it.
    lent = HandOff(["x"])
    item = await lent.get()
    waiting = asyncio.ensure_future(lent.get())
    await settle()
    newcomer = asyncio.ensure_future(lent.get())
    lent.put(item)
    await settle()
    assert waiting.done() and waiting.result() == "x"
    assert not newcomer.done()
    lent.put(waiting.result())
    assert await newcomer == "x"


async def test_waiters_are_served_by_priority_then_in_the_order_they_asked() -> None:
    lent = HandOff(["x"])
    item = await lent.get()
    served: list[str] = []

    async def wait(name: str, priority: int) -> None:
        served.append(name + ":" + await lent.get(priority))
        lent.put("x")

    tasks = []
    for name, priority in (("late", 5), ("early", 1), ("late-again", 5), ("earliest", 0)):
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await settle()
    assert lent.wanted_before(1) and not lent.wanted_before(0)
    lent.put(item)
    await asyncio.gather(*tasks)
    assert served == ["earliest:x", "early:x", "late:x", "late-again:x"]
    assert not lent.wanted_before(10)


async def test_free_items_are_lent_last_returned_first() -> None:
    lent = HandOff(["a", "b"])
    assert await lent.get() == "b"
    lent.put("b")
    assert await lent.get() == "b"
    assert await lent.get() == "a"


async def test_a_waiter_cancelled_before_it_runs_passes_its_item_on() -> None:
    lent = HandOff(["x"])
    item = await lent.get()
    first = asyncio.ensure_future(lent.get())
    second = asyncio.ensure_future(lent.get())
    await settle()
    lent.put(item)  # handed to first, which is cancelled before it takes it
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second == "x"


async def test_a_waiter_cancelled_while_it_waits_is_skipped() -> None:
    lent = HandOff(["x"])
    item = await lent.get()
    gone = asyncio.ensure_future(lent.get(0))
    kept = asyncio.ensure_future(lent.get(1))
    await settle()
    gone.cancel()
    await settle()
    assert lent.wanted_before(2) and not lent.wanted_before(1)
    lent.put(item)
    assert await kept == "x"
