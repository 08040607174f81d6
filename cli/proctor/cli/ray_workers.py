"""Grade-workers as Ray actors, for a team whose machines are already a Ray cluster (the ``ray`` extra).

Each actor is one ``proctor grade-worker``: it claims rows from the dataserver's experience store over the same
HTTP lease protocol, grades them in grader processes of its own and collects the rewards, so a row whose actor
dies is leased again once its lease ends, as with any worker. Ray only places and starts the actors.

    ray.init()                                          # or ray.init(address="auto") to join a cluster
    workers = RayGradeWorkers(GradeWorkerOptions("http://10.0.0.5:8000", processes=4), actors=8)
    ...
    workers.stop()                                      # each actor's WorkerStats

``proctor grade-worker --server URL --ray-actors 8 [--ray-address auto]`` does the same from the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
from types import FrameType
from typing import Any

import ray

from proctor.cli.grade_worker import GradeWorkerOptions, grade
from proctor.server.grade_worker import WorkerStats
from proctor.server.logs import configure_logging

__all__ = ["RayGradeWorkers", "serve_on_ray"]

# How often the command line looks for a signal while the actors run.
_POLL_S = 0.5


class _GradeWorkerActor:
    """One grade-worker in a Ray actor; ``run`` and ``stop`` are called at once (``max_concurrency=2``)."""

    def __init__(self, options: GradeWorkerOptions, log_level: str) -> None:
        configure_logging(log_level, "text")
        self._options = options
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._stopped = threading.Event()

    def run(self) -> WorkerStats:
        async def main() -> WorkerStats:
            stop = asyncio.Event()
            self._running = (asyncio.get_running_loop(), stop)
            if self._stopped.is_set():
                return WorkerStats()
            return await grade(self._options, stop)

        return asyncio.run(main())

    def stop(self) -> None:
        self._stopped.set()
        # A stop that comes before run has its loop is seen by run itself.
        if (running := self._running) is not None:
            loop, stop = running
            with contextlib.suppress(RuntimeError):  # run ended meanwhile and closed its loop
                loop.call_soon_threadsafe(stop.set)


class RayGradeWorkers:
    """``actors`` grade-workers started as Ray actors in the cluster ``ray.init()`` connected this process to.

    Each runs ``options.processes`` grader processes (1 when None: Ray places the actors on the cores) and asks
    Ray for as many CPUs. :meth:`wait` returns once every actor has ended by itself (``exit_when_idle_s``);
    :meth:`stop` ends them and returns what each did.
    """

    def __init__(self, options: GradeWorkerOptions, actors: int, *, log_level: str = "info") -> None:
        if actors < 1:
            raise ValueError(f"actors: {actors} is below 1; start at least one grade-worker")
        options = dataclasses.replace(options, processes=options.processes or 1)
        actor = ray.remote(_GradeWorkerActor).options(num_cpus=options.processes, max_concurrency=2)
        # Ray's type hints do not follow an actor's methods: its handles are untyped here.
        self._actors: list[Any] = [actor.remote(options, log_level) for _ in range(actors)]
        self._runs = [actor.run.remote() for actor in self._actors]

    def wait(self, timeout: float | None = None) -> list[WorkerStats] | None:
        """Each actor's stats once all have ended, or None when ``timeout`` passes first."""
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        if len(done) < len(self._runs):
            return None
        stats: list[WorkerStats] = ray.get(self._runs)
        return stats

    def stop(self) -> list[WorkerStats]:
        """Ask every actor to stop after its current rows, wait for them, and end them."""
        ray.get([actor.stop.remote() for actor in self._actors])
        try:
            stats: list[WorkerStats] = ray.get(self._runs)
        finally:
            for actor in self._actors:
                ray.kill(actor)
        return stats


def serve_on_ray(options: GradeWorkerOptions, actors: int, *, address: str | None) -> int:
    """``proctor grade-worker --ray-actors N``: run the actors until they end by themselves, or SIGINT/SIGTERM."""
    signalled = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signalled.set()

    previous: dict[int, Any] = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    try:
        workers = RayGradeWorkers(options, actors)
        while (stats := workers.wait(timeout=_POLL_S)) is None and not signalled.is_set():
            pass
        if stats is None:
            stats = workers.stop()
    except ValueError as exc:  # an actor's, raised again here: graders this machine cannot import
        print(f"proctor grade-worker: {exc}")
        return 2
    finally:
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(
        f"proctor grade-worker: {actors} Ray actors stopped: {sum(s.graded for s in stats)} rows graded, "
        f"{sum(s.refused for s in stats)} results refused (lease ended)"
    )
    return 0
