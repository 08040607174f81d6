"""A pool of grader processes, each completion held to its own time limit.

Graders are arbitrary Python (sympy-backed math checks, user code) that may be slow, hang, or crash the
interpreter, so they run in worker processes. A request's completions go to the workers in chunks, one
message per chunk each way (the round trip to a process costs more than a plain-number grade), shared among
the workers down to one completion a chunk once completions are seen to take longer than the round trip:

- **Time limits.** A worker arms a timer for each completion; when it fires, the grader is interrupted with
  an exception that ``except Exception`` does not catch, that completion is a timeout, and the worker goes on
  with the next. A grader that cannot be interrupted (stuck in C code, or one that disarms the timer) is
  caught by the server instead: it expects a message from the worker at least every time limit plus
  ``_FLUSH_S`` (a worker sends what it has whenever that long has passed), kills the worker when none
  comes, and starts a fresh one.
- **Attribution.** Results are sent in order. When a worker dies or is killed with results unsent, it is not
  known which of the unanswered completions was at fault: if there is one, it is; if there are several, each
  runs again on its own, and the one that fails alone is the one that fails.

Workers are fresh interpreters (``python -m proctor.server.grading.pool FD PPID``) talking over a socket pair,
not ``multiprocessing`` children: those re-import the parent's ``__main__`` module in every worker, which
breaks any program that builds the app without an ``if __name__ == "__main__"`` guard. A worker inherits
the parent's ``sys.path``, so a custom grader importable in the server is importable in its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from proctor.server.exceptions import ProctorError
from proctor.server.grading.base import GradeInput, Verdict
from proctor.server.grading.handoff import HandOff
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.registry import LocalGrader, load_callable, prepare_grader

__all__ = ["GraderPool", "GraderPoolError", "Task", "TaskOutcomes"]

log = logging.getLogger("proctor.grading")

_BOOT_TIMEOUT_S = 60.0
_GRADERS = "--graders"  # in a worker's arguments: the grader references after it, the modules to import before
_MIN_CHUNK, _MAX_CHUNK = 8, 64  # tasks per message to a worker
# A message to a worker and its answer cost about 0.12 ms here (one cheap task a call, timed): a chunk is split
# further only while its tasks take longer than about twice that, so that grading them side by side pays.
_MESSAGE_S = 0.25e-3
# A worker sends the results it has whenever this long has passed since it last sent: the server then
# hears from a healthy worker at least every time limit + _FLUSH_S, without a message per completion.
_FLUSH_S = 0.05
# How late past that a worker may be before the server kills it: a timer interrupts Python code only
# between bytecodes, so a grader busy in one long C call overruns its limit by that call.
_GRACE_S = 1.0

# One completion with the local graders of its source.
Task = tuple[Sequence[LocalGrader], GradeInput]
# A task's outcome per grader key.
TaskOutcomes = dict[str, GraderOutcome]
# What a worker sends back for one grader of one task: a score, a (score, detail) verdict, or (FailureKind value,
# message).
_Raw = float | tuple[float, dict[str, Any]] | tuple[str, str]


class GraderPoolError(ProctorError):
    """The pool cannot grade at all: it is shut down, or a worker process would not start."""


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with(parent: int) -> None:
    """Make this worker exit as soon as the server process ``parent`` is gone, even by ``kill -9``.

    Without it a worker busy in a slow grader runs on until the grader returns and its next write fails.
    """
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            # The parent may have died before prctl ran: then no signal will ever come.
            if os.getppid() != parent:
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _OutOfTime(BaseException):
    """Raised into a grader by the worker's timer. A BaseException, so that a grader's own
    ``except Exception`` (math_verify has many) cannot turn a timeout into a score."""


_loaded: dict[str, Any] = {}  # grader functions by reference, imported once per worker
_armed = False  # whether a task's timer is running: a signal that lands after the task ended is dropped


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _armed:
        raise _OutOfTime


def _timeout_message(timeout_s: float) -> str:
    return f"graders did not finish within {timeout_s:g}s"


def _timed_out(n: int, timeout_s: float) -> list[_Raw]:
    return [(FailureKind.TIMEOUT.value, _timeout_message(timeout_s))] * n


def _grade(graders: Sequence[tuple[str, Mapping[str, Any]]], sample: GradeInput, timeout_s: float) -> list[_Raw]:
    """The task's results, one per grader, within ``timeout_s`` for all of them together."""
    global _armed
    out: list[_Raw] = []
    _armed = True
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        for ref, params in graders:
            try:
                fn = _loaded.get(ref)
                if fn is None:
                    fn = _loaded[ref] = load_callable(ref)
                result = fn(sample, **params)
                score = float(result.score if isinstance(result, Verdict) else result)
                if not math.isfinite(score):
                    raise ValueError(f"returned {score}, not a finite number")
                out.append((score, dict(result.detail)) if isinstance(result, Verdict) else score)
            except Exception as exc:
                out.append((FailureKind.ERROR.value, f"{type(exc).__name__}: {exc}"))
    finally:
        _armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    return out


def _worker_main(conn: Connection, preload: Sequence[str], refs: Sequence[str] = ()) -> None:
    """Runs in each worker process: prepare the graders ``refs`` names, then grade chunks until the connection
    closes (or the server dies).

    A chunk is ``(timeout_s, grader_sets, tasks)`` with tasks ``(index into grader_sets, GradeInput fields)``. Results
    go back in order, in lists sent whenever ``_FLUSH_S`` has passed and at the end of the chunk.
    """
    # Ctrl-C goes to the whole process group; the server decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in preload:
        __import__(module)
    for ref in refs:
        # Outside any completion's time limit: an import slower than the limit, cut short under it, would be
        # tried again (and cut short again) by every completion. One that fails here fails each completion, as
        # its error.
        with contextlib.suppress(Exception):
            _loaded[ref] = prepare_grader(ref)
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        timeout_s, grader_sets, tasks = chunk
        # Set again for every chunk: a grader may have installed a handler of its own.
        signal.signal(signal.SIGALRM, _on_alarm)
        done: list[list[_Raw]] = []
        sent = time.monotonic()
        for index, fields in tasks:
            graders = grader_sets[index]
            try:
                done.append(_grade(graders, GradeInput(*fields), timeout_s))
            except _OutOfTime:  # raised inside the grader, or as _grade was disarming the timer
                done.append(_timed_out(len(graders), timeout_s))
            now = time.monotonic()
            if now - sent >= _FLUSH_S:
                conn.send(done)
                done, sent = [], now
        if done:
            conn.send(done)


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    conn: Connection


class GraderPool:
    """``await pool.run(graders, sample, timeout_s)`` grades one completion in a worker process."""

    def __init__(
        self,
        workers: int,
        *,
        preload: Sequence[str] = ("proctor.server.grading.builtin",),
        graders: Sequence[str] = (),
    ) -> None:
        """``preload``: modules each worker imports as it starts; ``graders``: references of the graders it will
        run, imported and prepared (:func:`~proctor.server.grading.registry.prepare_grader`) before it grades."""
        if workers < 1:
            raise ValueError(f"a grader pool needs at least 1 worker, got {workers}")
        self.size = workers
        self._preload = list(preload)
        self._graders = list(graders)
        # A freed worker goes to the earliest request that waits for one (see HandOff).
        self._idle: HandOff[_Worker] = HandOff()
        self._requests = itertools.count()
        self._all: set[_Worker] = set()
        self._task_s: float | None = None  # seconds a task takes in a worker, a moving average over chunks
        self._closed = False
        self._replacing: set[asyncio.Task[None]] = set()
        self.replaced = 0

    async def start(self) -> None:
        """Start the worker processes; on failure or cancellation, those started are stopped again."""
        # Threads run on when the call that awaits them is cancelled: each is awaited through a shield, so that
        # the processes a cancelled start had under way are known, and stopped, before it ends.
        spawns = [asyncio.ensure_future(asyncio.to_thread(self._spawn)) for _ in range(self.size)]
        try:
            workers = await asyncio.gather(*(asyncio.shield(s) for s in spawns))
        except BaseException:
            await asyncio.gather(*spawns, return_exceptions=True)
            await self.close()
            raise
        for w in workers:
            self._idle.put(w)

    def _spawn(self) -> _Worker:
        # The worker dies with this process (see _die_with). On Linux the signal comes when the *thread*
        # that spawned it ends; _spawn runs in the event loop's default executor, whose threads live as long
        # as the loop.
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        args = [str(child.fileno()), str(os.getpid()), *self._preload, _GRADERS, *self._graders]
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, *args],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        conn = Connection(parent.detach())
        # Wait for the interpreter to start and import the graders, so that a task never waits on a boot.
        try:
            ready = conn.poll(_BOOT_TIMEOUT_S) and conn.recv() == "ready"
        except (EOFError, OSError):  # it died while starting
            ready = False
        if not ready:
            running = process.poll() is None
            process.kill()
            process.wait()
            conn.close()
            if running:
                raise GraderPoolError(
                    f"a grader process was not ready within {_BOOT_TIMEOUT_S:g} s: it imports and prepares the "
                    f"graders first ({', '.join(self._graders) or 'none'}); make their import quicker"
                )
            raise GraderPoolError(f"a grader process did not start (exit code {process.returncode})")
        worker = _Worker(process, conn)
        self._all.add(worker)
        return worker

    async def run(self, graders: Sequence[LocalGrader], sample: GradeInput, timeout_s: float) -> TaskOutcomes:
        """Grade one completion with every local grader of its source, within ``timeout_s`` together."""
        [outcomes] = await self.run_many([(graders, sample)], timeout_s)
        return outcomes

    async def run_many(self, tasks: Sequence[Task], timeout_s: float) -> list[TaskOutcomes]:
        """Grade many completions, each within ``timeout_s``: the outcomes of each task, in order.

        A grader that raises, runs out of time or takes its process down is a failed outcome of that
        grader for that completion, never an exception here; the other completions are graded as usual.
        """
        if self._closed:
            raise GraderPoolError("the grader pool is shut down")
        results: list[TaskOutcomes | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        suspects: deque[int] = deque()  # tasks of a failed chunk whose fault is not known: run one by one
        request = next(self._requests)

        async def drain() -> None:
            worker: _Worker | None = None
            try:
                while queue or suspects:
                    if worker is None:
                        worker = await self._idle.get(request)
                        if not (queue or suspects):
                            break
                    if suspects:
                        chunk = [suspects.popleft()]
                    else:
                        # Share what is left among the workers, so that one request uses all of them, but not in
                        # slivers: waking a process costs about as much as grading a few cheap completions.
                        size = min(_MAX_CHUNK, max(self._min_chunk(), -(-len(queue) // self.size)))
                        chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
                    # While it grades, the worker is _run_chunk's: one that fails, or is cancelled, is replaced.
                    busy, worker = worker, None
                    done, failure = await self._run_chunk(busy, [tasks[i] for i in chunk], timeout_s)
                    if busy in self._all:  # not replaced: _run_chunk keeps a worker that answered the whole chunk
                        if self._idle.wanted_before(request):
                            self._idle.put(busy)
                        else:
                            worker = busy
                    for i, raw in zip(chunk, done, strict=False):
                        results[i] = _outcomes(tasks[i][0], raw)
                    unanswered = chunk[len(done) :]
                    if failure is not None and len(unanswered) == 1:
                        results[unanswered[0]] = {g.key: failure for g in tasks[unanswered[0]][0]}
                    else:
                        suspects.extend(unanswered)
            finally:
                if worker is not None:
                    self._idle.put(worker)

        # No more drainers than there are chunks to take: a spare one would wait for a worker only to hand it
        # back, holding the request up (a failed worker's replacement takes a while to arrive).
        chunks = -(-len(tasks) // self._min_chunk())
        await asyncio.gather(*(drain() for _ in range(min(self.size, chunks))))
        lost = GraderOutcome.failed(FailureKind.CRASH, "not graded: the grader pool stopped")
        return [r if r is not None else {g.key: lost for g in t[0]} for r, t in zip(results, tasks, strict=True)]

    def _min_chunk(self) -> int:
        """The fewest tasks worth a message to a worker: a few cheap ones, or one that takes a while (a sandboxed
        program, math-verify on LaTeX), so that even a small request's tasks are graded side by side."""
        if self._task_s is None:
            return _MIN_CHUNK
        return max(1, min(_MIN_CHUNK, math.ceil(_MESSAGE_S / max(self._task_s, 1e-9))))

    async def _run_chunk(
        self, worker: _Worker, chunk: list[Task], timeout_s: float
    ) -> tuple[list[list[_Raw]], GraderOutcome | None]:
        """The chunk's results in order, and, if the worker failed before answering them all, why."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        fd = worker.conn.fileno()
        out: list[list[_Raw]] = []
        failure: GraderOutcome | None = None
        # Each source's graders are sent once per chunk, not with every completion.
        sets: dict[int, int] = {}
        grader_sets: list[list[tuple[str, dict[str, Any]]]] = []
        # Samples go as plain tuples: pickling a slotted dataclass costs several times as much.
        numbered: list[tuple[int, tuple[Any, ...]]] = []
        for graders, sample in chunk:
            index = sets.get(id(graders))
            if index is None:
                index = sets[id(graders)] = len(grader_sets)
                grader_sets.append([(g.ref, dict(g.params)) for g in graders])
            fields = (sample.prompt, sample.completion, sample.answer, sample.metadata, sample.completion_tokens)
            numbered.append((index, fields))
        try:
            worker.conn.send((timeout_s, grader_sets, numbered))
            while len(out) < len(chunk):
                if not worker.conn.poll():
                    ready: asyncio.Future[None] = loop.create_future()
                    loop.add_reader(fd, _resolve, ready)
                    try:
                        await asyncio.wait_for(ready, timeout_s + _FLUSH_S + _GRACE_S)
                    except TimeoutError:
                        # Its own timer did not stop the grader: kill the worker (see the module's docstring).
                        failure = GraderOutcome.failed(FailureKind.TIMEOUT, _timeout_message(timeout_s))
                        return out, failure
                    finally:
                        loop.remove_reader(fd)
                try:
                    out.extend(worker.conn.recv())
                except (EOFError, OSError):
                    # The socket closes a moment before the process is reaped; wait for the exit code.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await asyncio.to_thread(worker.process.wait, 2.0)
                    failure = GraderOutcome.failed(
                        FailureKind.CRASH, f"the grader process died (exit code {worker.process.returncode})"
                    )
                    return out, failure
            task_s = (time.perf_counter() - started) / len(chunk)
            self._task_s = task_s if self._task_s is None else 0.8 * self._task_s + 0.2 * task_s
            return out, None
        finally:
            if len(out) < len(chunk) or failure is not None:
                # Failed, or cancelled mid-chunk: the worker's state is unknown, so replace it. A healthy one
                # stays with the caller, who hands it on.
                self._all.discard(worker)
                self.replaced += 1
                self._replacing.add(loop.create_task(self._replace(worker)))

    async def _replace(self, old: _Worker) -> None:
        try:
            await asyncio.to_thread(self._retire, old)
            if self._closed:
                return
            worker = await asyncio.to_thread(self._spawn)
        except Exception:
            log.exception("could not start a replacement grader process")
            return
        finally:
            current = asyncio.current_task()
            if current is not None:
                self._replacing.discard(current)
        if self._closed:
            await asyncio.to_thread(self._retire, worker)
        else:
            self._idle.put(worker)

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        with contextlib.suppress(Exception):
            worker.process.kill()
        with contextlib.suppress(Exception):
            worker.conn.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(timeout=1)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ask idle workers to exit, then kill whatever is still running after ``timeout_s``."""
        self._closed = True
        if self._replacing:
            await asyncio.gather(*self._replacing, return_exceptions=True)
        for worker in list(self._all):
            with contextlib.suppress(Exception):
                worker.conn.send(None)

        def _join_all() -> None:
            deadline = time.monotonic() + timeout_s
            for worker in list(self._all):
                try:
                    worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    worker.process.kill()
                    worker.process.wait()
                with contextlib.suppress(Exception):
                    worker.conn.close()
            self._all.clear()

        await asyncio.to_thread(_join_all)

    def pids(self) -> Mapping[int, bool]:
        """Worker pids and whether each is alive (for tests and diagnostics)."""
        return {w.process.pid: w.process.poll() is None for w in self._all}


def _outcomes(graders: Sequence[LocalGrader], raw: Sequence[_Raw]) -> TaskOutcomes:
    out: TaskOutcomes = {}
    for g, r in zip(graders, raw, strict=True):
        if isinstance(r, tuple) and isinstance(r[0], str):
            out[g.key] = GraderOutcome.failed(FailureKind(r[0]), str(r[1]))
        elif isinstance(r, tuple):
            out[g.key] = GraderOutcome.scored(r[0], r[1])
        else:
            out[g.key] = GraderOutcome.scored(r)
    return out


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


if __name__ == "__main__":
    # python -m proctor.server.grading.pool FD PPID [MODULE ...] [--graders REF ...]: a worker, spawned by
    # GraderPool._spawn.
    # PPID may be missing when a server that was started before an upgrade replaces a worker.
    fd, *args = sys.argv[1:]
    if args and args[0].isdigit():
        _die_with(int(args.pop(0)))
    modules, graders = args, []
    if _GRADERS in args:
        at = args.index(_GRADERS)
        modules, graders = args[:at], args[at + 1 :]
    _worker_main(Connection(int(fd)), modules, graders)
