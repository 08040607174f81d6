"""The grader process pool: per-completion timeouts, crashes, errors, replacement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proctor.server.grading.base import GradeInput
from proctor.server.grading.pool import GraderCrashed, GraderPool, GraderTimeout
from proctor.server.grading.registry import LocalGrader

pytestmark = pytest.mark.anyio

GRADERS = """
import os
import time

def right(sample):
    return 1.0 if sample.completion == sample.answer else 0.0

def sleepy(sample, *, seconds):
    time.sleep(seconds)
    return 1.0

def boom(sample):
    raise ValueError("no reference answer")

def nan(sample):
    return float("nan")

def die(sample):
    os._exit(9)
"""

SAMPLE = GradeInput(prompt="1+1", completion="2", answer="2")


@pytest.fixture
def graders(tmp_path: Path) -> dict[str, LocalGrader]:
    path = tmp_path / "g.py"
    path.write_text(GRADERS)

    def make(name: str, **params: float) -> LocalGrader:
        return LocalGrader(name, f"{path}:{name}", params, 1.0, False)

    return {
        "right": make("right"),
        "sleepy": make("sleepy", seconds=30),
        "quick": make("sleepy", seconds=0.05),
        "boom": make("boom"),
        "nan": make("nan"),
        "die": make("die"),
    }


@pytest.fixture
async def pool() -> GraderPool:
    p = GraderPool(2)
    await p.start()
    yield p  # type: ignore[misc]
    await p.close()


async def test_grades_in_a_worker(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    assert await pool.run([graders["right"]], SAMPLE, 5) == {"right": 1.0}


async def test_an_exception_is_reported_per_grader(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    scores = await pool.run([graders["right"], graders["boom"], graders["nan"]], SAMPLE, 5)
    assert scores == {
        "right": 1.0,
        "boom": "ValueError: no reference answer",
        "nan": "ValueError: returned nan, not a finite number",
    }


async def test_a_hung_grader_times_out_and_its_worker_is_replaced(
    pool: GraderPool, graders: dict[str, LocalGrader]
) -> None:
    before = set(pool.pids())
    with pytest.raises(GraderTimeout, match=r"graders did not finish within 0.3s"):
        await pool.run([graders["sleepy"]], SAMPLE, 0.3)
    # The survivor keeps serving while the replacement starts.
    assert await pool.run([graders["right"]], SAMPLE, 5) == {"right": 1.0}
    for _ in range(100):
        if len(pool.pids()) == 2:
            break
        await asyncio.sleep(0.05)
    assert pool.replaced == 1
    assert len(set(pool.pids()) - before) == 1
    assert all(pool.pids().values())
    results = await asyncio.gather(*(pool.run([graders["right"]], SAMPLE, 5) for _ in range(8)))
    assert results == [{"right": 1.0}] * 8


async def test_a_dying_worker_is_a_crash(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    with pytest.raises(GraderCrashed, match=r"exit code 9"):
        await pool.run([graders["die"]], SAMPLE, 5)
    assert await pool.run([graders["right"]], SAMPLE, 5) == {"right": 1.0}


async def test_work_spreads_over_the_workers(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    # Sixteen 50 ms tasks on two workers: two chunks side by side (~0.4 s), not one after the other (~0.8 s).
    # The time limit is per task, so tasks queued in a chunk do not time out while they wait.
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await pool.run_many([([graders["quick"]], SAMPLE)] * 16, 0.5)
    assert results == [{"sleepy": 1.0}] * 16
    assert loop.time() - started < 0.7


async def test_a_timeout_inside_a_chunk_fails_only_that_task(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    tasks = [([graders["right"]], SAMPLE)] * 3 + [([graders["sleepy"]], SAMPLE)] + [([graders["right"]], SAMPLE)] * 4
    results = await pool.run_many(tasks, 0.5)
    assert isinstance(results[3], GraderTimeout)
    # The tasks after it in its chunk were sent back to the queue and graded by a worker.
    assert [r for i, r in enumerate(results) if i != 3] == [{"right": 1.0}] * 7
    assert pool.replaced == 1


async def test_a_crash_inside_a_chunk_fails_only_that_task(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    tasks = [([graders["right"]], SAMPLE), ([graders["die"]], SAMPLE), ([graders["right"]], SAMPLE)]
    results = await pool.run_many(tasks, 5)
    assert results[0] == results[2] == {"right": 1.0}
    assert isinstance(results[1], GraderCrashed)


async def test_a_cancelled_task_does_not_poison_the_pool(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    task = asyncio.ensure_future(pool.run([graders["sleepy"]], SAMPLE, 30))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    results = await asyncio.gather(*(pool.run([graders["right"]], SAMPLE, 5) for _ in range(4)))
    assert results == [{"right": 1.0}] * 4


async def test_close_stops_every_worker(graders: dict[str, LocalGrader]) -> None:
    p = GraderPool(2)
    await p.start()
    processes = [w.process for w in p._all]
    await p.close()
    assert all(proc.poll() is not None for proc in processes)
    with pytest.raises(Exception, match="shut down"):
        await p.run([graders["right"]], SAMPLE, 5)


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least 1 worker"):
        GraderPool(0)
