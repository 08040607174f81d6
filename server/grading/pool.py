"""A pool of grader processes with a per-completion timeout.

Graders are arbitrary Python (sympy-backed math checks, user code) that may be slow, hang, or crash the
interpreter. Each completion is sent to one idle worker process; the event loop waits for the answer on
the worker's pipe with a deadline. A worker that misses its deadline is killed and replaced: unlike a
thread, a process can be stopped mid-computation, which is why a plain ``ProcessPoolExecutor`` (whose
futures cannot be cancelled once running) is not used here.

Workers are fresh interpreters (``python -m proctor.server.grading.pool FD PPID``) talking over a socket pair,
not ``multiprocessing`` children: those re-import the parent's ``__main__`` module in every worker, which
breaks any program that builds the app without an ``if __name__ == "__main__"`` guard. A worker inherits
the parent's ``sys.path``, so a custom grader importable in the server is importable in its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from proctor.server.grading.base import GradeInput
from proctor.server.grading.registry import LocalGrader, load_callable

__all__ = [
    "GraderCrashed",
    "GraderPool",
    "GraderPoolError",
    "GraderTimeout",
    "ItemScores",
    "default_workers",
]

log = logging.getLogger("proctor.grading")

_BOOT_TIMEOUT_S = 60.0
_MIN_CHUNK, _MAX_CHUNK = 8, 64  # tasks per message to a worker

# What one task returns: a score per grader key, or the error text of a grader that raised.
ItemScores = dict[str, float | str]


class GraderPoolError(Exception):
    """A completion whose graders did not return."""


class GraderTimeout(GraderPoolError):
    pass


class GraderCrashed(GraderPoolError):
    pass


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


def _worker_main(conn: Connection, preload: Sequence[str]) -> None:
    """Runs in each worker process: grade chunks of tasks until the connection closes (or the server dies).

    A chunk is a list of ``(graders, sample)`` tasks; the result of each task is sent as soon as it is ready,
    so that the server can hold every task to its own time limit.
    """
    # Ctrl-C goes to the whole process group; the server decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in preload:
        __import__(module)
    conn.send("ready")
    fns: dict[str, Any] = {}
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for graders, sample in chunk:
            out: ItemScores = {}
            for key, ref, params in graders:
                try:
                    fn = fns.get(ref)
                    if fn is None:
                        fn = fns[ref] = load_callable(ref)
                    score = float(fn(sample, **params))
                    if not math.isfinite(score):
                        raise ValueError(f"returned {score}, not a finite number")
                    out[key] = score
                except Exception as exc:
                    out[key] = f"{type(exc).__name__}: {exc}"
            conn.send(out)


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    conn: Connection


class GraderPool:
    """``await pool.run(graders, sample, timeout_s)`` grades one completion in a worker process."""

    def __init__(self, workers: int, *, preload: Sequence[str] = ("proctor.server.grading.builtin",)) -> None:
        if workers < 1:
            raise ValueError(f"a grader pool needs at least 1 worker, got {workers}")
        self.size = workers
        self._preload = list(preload)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._closed = False
        self._replacing: set[asyncio.Task[None]] = set()
        self.replaced = 0

    async def start(self) -> None:
        workers = await asyncio.gather(*(asyncio.to_thread(self._spawn) for _ in range(self.size)))
        for w in workers:
            self._idle.put_nowait(w)

    def _spawn(self) -> _Worker:
        # The worker dies with this process (see _die_with). On Linux the signal comes when the *thread*
        # that spawned it ends; _spawn runs in the event loop's default executor, whose threads live as long
        # as the loop.
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(child.fileno()), str(os.getpid()), *self._preload],
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
            process.kill()
            process.wait()
            conn.close()
            raise GraderPoolError(f"a grader process did not start (exit code {process.returncode})")
        worker = _Worker(process, conn)
        self._all.add(worker)
        return worker

    async def run(self, graders: Sequence[LocalGrader], sample: GradeInput, timeout_s: float) -> ItemScores:
        """Grade one completion with every local grader of its source.

        Raises :class:`GraderTimeout` when the graders together take longer than ``timeout_s`` seconds and
        :class:`GraderCrashed` when the worker process dies; a grader that raises is reported in the
        returned mapping as its error text.
        """
        [result] = await self.run_many([(graders, sample)], timeout_s)
        if isinstance(result, GraderPoolError):
            raise result
        return result

    async def run_many(
        self, tasks: Sequence[tuple[Sequence[LocalGrader], GradeInput]], timeout_s: float
    ) -> list[ItemScores | GraderPoolError]:
        """Grade many completions, each within ``timeout_s``; a result per task, in order.

        The tasks are spread over the workers in chunks (one message per chunk, not per task: the round
        trip to a process costs more than most graders). A worker answers task by task, and each answer
        has ``timeout_s`` from the previous one; a task that misses it gets a :class:`GraderTimeout`, its
        worker is replaced, and the tasks of the chunk it never started go back to the queue.
        """
        if self._closed:
            raise GraderPoolError("the grader pool is shut down")
        results: list[ItemScores | GraderPoolError | None] = [None] * len(tasks)
        queue = list(range(len(tasks)))
        queue.reverse()  # popped from the end: first task first

        async def drain() -> None:
            while queue:
                worker = await self._idle.get()
                if not queue:
                    self._idle.put_nowait(worker)
                    return
                # Share what is left among the workers, so that one request uses all of them, but not in
                # slivers: waking a process costs about as much as grading a few cheap completions.
                size = min(_MAX_CHUNK, max(_MIN_CHUNK, -(-len(queue) // self.size)))
                chunk = [queue.pop() for _ in range(min(size, len(queue)))]
                done = await self._run_chunk(worker, [tasks[i] for i in chunk], timeout_s)
                for i, result in zip(chunk, done, strict=False):
                    results[i] = result
                queue.extend(reversed(chunk[len(done) :]))  # not started: back to the front of the queue

        # No more drainers than there are chunks to take: a spare one would wait for a worker only to hand it
        # back, holding the request up (a timed-out worker's replacement takes a while to arrive).
        chunks = -(-len(tasks) // _MIN_CHUNK)
        await asyncio.gather(*(drain() for _ in range(min(self.size, chunks))))
        return [r if r is not None else GraderPoolError("not graded") for r in results]

    async def _run_chunk(
        self, worker: _Worker, chunk: list[tuple[Sequence[LocalGrader], GradeInput]], timeout_s: float
    ) -> list[ItemScores | GraderPoolError]:
        """Results of the chunk's tasks in order, up to and including the first that failed the worker."""
        loop = asyncio.get_running_loop()
        fd = worker.conn.fileno()
        out: list[ItemScores | GraderPoolError] = []
        healthy = False
        try:
            worker.conn.send([([(g.key, g.ref, dict(g.params)) for g in graders], sample) for graders, sample in chunk])
            for _ in chunk:
                if not worker.conn.poll():
                    ready: asyncio.Future[None] = loop.create_future()
                    loop.add_reader(fd, _resolve, ready)
                    try:
                        await asyncio.wait_for(ready, timeout_s)
                    except TimeoutError:
                        out.append(GraderTimeout(f"graders did not finish within {timeout_s:g}s"))
                        return out
                    finally:
                        loop.remove_reader(fd)
                try:
                    out.append(worker.conn.recv())
                except (EOFError, OSError):
                    # The socket closes a moment before the process is reaped; wait for the exit code.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await asyncio.to_thread(worker.process.wait, 2.0)
                    out.append(GraderCrashed(f"the grader process died (exit code {worker.process.returncode})"))
                    return out
            healthy = True
            return out
        finally:
            if healthy:
                self._idle.put_nowait(worker)
            else:
                # Timed out, crashed or cancelled mid-chunk: the worker's state is unknown, so replace it.
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
            self._idle.put_nowait(worker)

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


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def default_workers() -> int:
    """One grader process per core the server may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


if __name__ == "__main__":
    # python -m proctor.server.grading.pool FD PPID [MODULE ...]: a worker, spawned by GraderPool._spawn.
    # PPID may be missing when a server that was started before an upgrade replaces a worker.
    fd, *args = sys.argv[1:]
    if args and args[0].isdigit():
        _die_with(int(args.pop(0)))
    _worker_main(Connection(int(fd)), args)
