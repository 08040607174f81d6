"""The grader process pool: per-completion timeouts, crashes, errors, attribution, replacement."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from proctor.server.grading.base import GradeInput
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.pool import GraderPool, GraderPoolError, Task, TaskOutcomes
from proctor.server.grading.registry import LocalGrader
from tests.server.grading.conftest import settle

pytestmark = pytest.mark.anyio

GRADERS = """
import os
import signal
import time

def right(sample):
    return 1.0 if sample.completion == sample.answer else 0.0

def sleepy(sample, *, seconds):
    time.sleep(seconds)
    return 1.0

def stubborn(sample, *, seconds):
    # Disarms the worker's timer, as a grader with an alarm of its own would: only the server can stop it.
    signal.setitimer(signal.ITIMER_REAL, 0)
    time.sleep(seconds)
    return 1.0

def swallow(sample):
    # A grader that catches every Exception must still not turn a timeout into a score.
    try:
        time.sleep(30)
    except Exception:
        return 1.0
    return 1.0

def boom(sample):
    raise ValueError("no reference answer")

def nan(sample):
    return float("nan")

def die(sample):
    os._exit(9)

def gated(sample, *, seconds):
    # Waits until the test opens the gate (a file beside this module), then scores 1.
    gate = os.path.join(os.path.dirname(__file__), "open")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(gate):
            return 1.0
        time.sleep(0.01)
    return 0.0

def rendezvous(sample, *, seconds):
    # Marks its process, then waits for another process to mark its own: a task sees two marks only if tasks
    # run in two processes side by side.
    marks = os.path.join(os.path.dirname(__file__), "marks")
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, str(os.getpid())), "w").close()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(os.listdir(marks)) >= 2:
            return 1.0
        time.sleep(0.01)
    return 0.0
"""

SAMPLE = GradeInput(prompt="1+1", completion="2", answer="2")
RIGHT = {"right": GraderOutcome.scored(1.0)}


def timed_out(key: str, seconds: float) -> dict[str, GraderOutcome]:
    return {key: GraderOutcome.failed(FailureKind.TIMEOUT, f"graders did not finish within {seconds:g}s")}


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
        "stubborn": make("stubborn", seconds=30),
        "swallow": make("swallow"),
        "boom": make("boom"),
        "nan": make("nan"),
        "die": make("die"),
        "rendezvous": make("rendezvous", seconds=20),
        "gated": make("gated", seconds=20),
    }


@contextlib.asynccontextmanager
async def started(p: GraderPool) -> AsyncIterator[GraderPool]:
    await p.start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def pool() -> AsyncIterator[GraderPool]:
    async with started(GraderPool(2)) as p:
        yield p


async def wait_for_workers(pool: GraderPool, n: int) -> None:
    for _ in range(200):
        if len(pool.pids()) == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the pool has {len(pool.pids())} workers, not {n}")


async def test_grades_in_a_worker(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    assert await pool.run([graders["right"]], SAMPLE, 5) == RIGHT


async def test_an_exception_is_reported_per_grader(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    outcomes = await pool.run([graders["right"], graders["boom"], graders["nan"]], SAMPLE, 5)
    assert outcomes == {
        "right": GraderOutcome.scored(1.0),
        "boom": GraderOutcome.failed(FailureKind.ERROR, "ValueError: no reference answer"),
        "nan": GraderOutcome.failed(FailureKind.ERROR, "ValueError: returned nan, not a finite number"),
    }


async def test_a_hung_grader_times_out_in_its_worker(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    before = set(pool.pids())
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await pool.run([graders["sleepy"]], SAMPLE, 0.3) == timed_out("sleepy", 0.3)
    assert loop.time() - started < 10  # a liveness bound
    # Interrupted by the worker's own timer: the worker lives on and keeps grading.
    assert pool.replaced == 0
    assert set(pool.pids()) == before
    results = await asyncio.gather(*(pool.run([graders["right"]], SAMPLE, 5) for _ in range(8)))
    assert results == [RIGHT] * 8


async def test_a_grader_that_catches_everything_still_times_out(
    pool: GraderPool, graders: dict[str, LocalGrader]
) -> None:
    assert await pool.run([graders["swallow"]], SAMPLE, 0.3) == timed_out("swallow", 0.3)


async def test_a_grader_the_timer_cannot_stop_is_killed_with_its_worker(
    pool: GraderPool, graders: dict[str, LocalGrader]
) -> None:
    before = set(pool.pids())
    assert await pool.run([graders["stubborn"]], SAMPLE, 0.3) == timed_out("stubborn", 0.3)
    # The survivor keeps serving while the replacement starts.
    assert await pool.run([graders["right"]], SAMPLE, 5) == RIGHT
    await wait_for_workers(pool, 2)
    assert pool.replaced == 1
    assert len(set(pool.pids()) - before) == 1
    assert all(pool.pids().values())


async def test_a_dying_worker_is_a_crash(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    outcomes = await pool.run([graders["die"]], SAMPLE, 5)
    assert outcomes == {"die": GraderOutcome.failed(FailureKind.CRASH, "the grader process died (exit code 9)")}
    assert await pool.run([graders["right"]], SAMPLE, 5) == RIGHT


async def test_work_spreads_over_the_workers(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    # Each task waits until a task in another process has started: one worker taking every task would wait
    # its 20 s out and score 0.
    results = await pool.run_many([([graders["rendezvous"]], SAMPLE)] * 16, 30)
    assert results == [{"rendezvous": GraderOutcome.scored(1.0)}] * 16


async def test_a_small_request_of_slow_tasks_is_graded_side_by_side(
    pool: GraderPool, graders: dict[str, LocalGrader]
) -> None:
    # Once the pool has seen tasks take 50 ms, one such task is worth a message of its own: each of these two
    # waits until a task in another process has started, and would wait its 20 s out and score 0 if one
    # process took both.
    await pool.run_many([([graders["quick"]], SAMPLE)] * 8, 5)
    results = await pool.run_many([([graders["rendezvous"]], SAMPLE)] * 2, 30)
    assert results == [{"rendezvous": GraderOutcome.scored(1.0)}] * 2


async def test_the_time_limit_is_per_task(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    # Sixteen 50 ms tasks on two workers, eight to a chunk: a chunk takes 0.4 s, each of its tasks 50 ms, and
    # none times out against a limit of 0.3 s while it waits its turn.
    results = await pool.run_many([([graders["quick"]], SAMPLE)] * 16, 0.3)
    assert results == [{"sleepy": GraderOutcome.scored(1.0)}] * 16


async def test_a_timeout_inside_a_chunk_fails_only_that_task(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    tasks = [([graders["right"]], SAMPLE)] * 3 + [([graders["sleepy"]], SAMPLE)] + [([graders["right"]], SAMPLE)] * 4
    results = await pool.run_many(tasks, 0.5)
    assert results[3] == timed_out("sleepy", 0.5)
    assert [r for i, r in enumerate(results) if i != 3] == [RIGHT] * 7
    assert pool.replaced == 0


@pytest.mark.parametrize("culprit", ["stubborn", "die"])
async def test_a_killed_worker_fails_only_the_task_at_fault(
    pool: GraderPool, graders: dict[str, LocalGrader], culprit: str
) -> None:
    # One chunk of twelve (a single worker takes them all): its worker dies or is killed with several
    # results unsent, so those tasks run again one by one, and only the culprit fails.
    tasks = [([graders["right"]], SAMPLE)] * 5 + [([graders[culprit]], SAMPLE)] + [([graders["right"]], SAMPLE)] * 6
    results = await pool.run_many(tasks, 0.3)
    kinds = [next(iter(r.values())).failure for r in results]
    assert kinds == [None] * 5 + [FailureKind.TIMEOUT if culprit == "stubborn" else FailureKind.CRASH] + [None] * 6
    assert [r for i, r in enumerate(results) if i != 5] == [RIGHT] * 11


async def test_many_sources_in_one_chunk(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    both = [graders["right"], graders["boom"]]
    tasks = [([graders["right"]], SAMPLE), (both, SAMPLE), ([graders["right"]], SAMPLE), (both, SAMPLE)]
    results = await pool.run_many(tasks, 5)
    boom = GraderOutcome.failed(FailureKind.ERROR, "ValueError: no reference answer")
    assert results == [RIGHT, {**RIGHT, "boom": boom}, RIGHT, {**RIGHT, "boom": boom}]


async def test_a_cancelled_task_does_not_poison_the_pool(pool: GraderPool, graders: dict[str, LocalGrader]) -> None:
    task = asyncio.ensure_future(pool.run([graders["sleepy"]], SAMPLE, 30))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    results = await asyncio.gather(*(pool.run([graders["right"]], SAMPLE, 5) for _ in range(4)))
    assert results == [RIGHT] * 4


def module_grader(path: Path, source: str, name: str) -> LocalGrader:
    """The grader ``name`` of a module written to ``path``."""
    path.write_text(source)
    return LocalGrader(name, f"{path}:{name}", {}, 1.0, False)


async def test_a_freed_worker_goes_to_the_request_that_waited_longest(
    graders: dict[str, LocalGrader], tmp_path: Path
) -> None:
    # One worker, busy with the first of two chunks of a large request; two small requests wait for it, the
    # second one after the first. The large one keeps the worker between its chunks (nobody who came earlier
    # waits), then the worker goes to the small requests in the order they came.
    done: list[str] = []
    large = [([graders["gated"]], SAMPLE)] + [([graders["right"]], SAMPLE)] * 127  # chunks of 64 and 64
    small = [([graders["right"]], SAMPLE)] * 8
    async with started(GraderPool(1)) as p:

        async def request(name: str, work: Sequence[Task]) -> list[TaskOutcomes]:
            results = await p.run_many(work, 30)
            done.append(name)
            return results

        tasks = []
        for name, work in (("large", large), ("first", small), ("second", small)):
            tasks.append(asyncio.ensure_future(request(name, work)))
            await settle()
        (tmp_path / "open").touch()
        results = await asyncio.gather(*tasks)
    assert done == ["large", "first", "second"]
    assert results == [[{"gated": GraderOutcome.scored(1.0)}] + [RIGHT] * 127, [RIGHT] * 8, [RIGHT] * 8]


async def test_a_request_cancelled_while_it_waits_for_a_worker_loses_none(
    graders: dict[str, LocalGrader], tmp_path: Path
) -> None:
    async with started(GraderPool(1)) as p:
        busy = asyncio.ensure_future(p.run([graders["gated"]], SAMPLE, 30))
        await settle()
        waiting = asyncio.ensure_future(p.run([graders["right"]], SAMPLE, 30))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        (tmp_path / "open").touch()
        assert await busy == {"gated": GraderOutcome.scored(1.0)}
        assert await asyncio.gather(*(p.run([graders["right"]], SAMPLE, 5) for _ in range(3))) == [RIGHT] * 3
        assert p.replaced == 0


async def test_a_grader_whose_import_outlasts_the_time_limit_is_imported_before_grading(tmp_path: Path) -> None:
    # Imported under a completion's limit, the import would be cut short, and tried (and cut short) again by
    # every completion after it: none would ever be graded.
    source = "import time\ntime.sleep(1.5)\n\ndef right(sample):\n    return 1.0\n"
    grader = module_grader(tmp_path / "slow.py", source, "right")
    async with started(GraderPool(1, graders=[grader.ref])) as p:
        assert await p.run_many([([grader], SAMPLE)] * 2, 0.5) == [RIGHT] * 2


async def test_a_grader_that_cannot_be_imported_fails_each_completion(tmp_path: Path) -> None:
    source = "raise RuntimeError('needs a GPU')\n\ndef right(sample):\n    return 1.0\n"
    grader = module_grader(tmp_path / "broken.py", source, "right")
    async with started(GraderPool(1, graders=[grader.ref])) as p:  # the worker starts all the same
        [outcomes] = await p.run_many([([grader], SAMPLE)], 5)
    assert outcomes == {"right": GraderOutcome.failed(FailureKind.ERROR, "RuntimeError: needs a GPU")}


async def test_math_verify_is_ready_before_the_first_latex_answer(tmp_path: Path) -> None:
    # math imports math-verify on its first LaTeX answer (0.2 s, and 0.08 s more for its parser): a pool that will
    # grade with math has its workers do that before they grade.
    source = "import sys\n\ndef imported(sample):\n    return float('math_verify' in sys.modules)\n"
    grader = module_grader(tmp_path / "probe.py", source, "imported")
    for refs, expected in (([grader.ref], 0.0), (["builtin:math", grader.ref], 1.0)):
        async with started(GraderPool(1, graders=refs)) as p:
            assert await p.run([grader], SAMPLE, 5) == {"imported": GraderOutcome.scored(expected)}


async def test_close_stops_every_worker(graders: dict[str, LocalGrader]) -> None:
    p = GraderPool(2)
    await p.start()
    pids = list(p.pids())
    await p.close()
    assert p.pids() == {}
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    with pytest.raises(GraderPoolError, match="the grader pool is shut down"):
        await p.run([graders["right"]], SAMPLE, 5)


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least 1 worker"):
        GraderPool(0)


def _grader_processes() -> list[int]:
    """This process's children that run a grader worker and have not ended, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"proctor.server.grading.pool" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_start_cancelled_midway_stops_the_processes_it_started() -> None:
    pool = GraderPool(2)
    start = asyncio.create_task(pool.start())
    while not _grader_processes():  # until a worker process exists (it is still importing, not yet ready)
        await asyncio.sleep(0.01)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert _grader_processes() == []
    assert pool.pids() == {}
