"""``proctor grade-worker``: the grader role of a dataserver's experience store, on this machine, or as Ray actors
(``--ray-actors``, :mod:`proctor.cli.ray_workers`).

Needs the ``server`` extra (the graders) and the client (the store over HTTP). Custom graders must be
importable here under the references the server resolved (``GET /graders``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import httpx
from pydantic import SecretStr

from proctor.client.errors import NotReadyError, ServerFailure, TransportError
from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.server.grade_worker import TABLES_PER_DISPATCH, GradeWorker, WorkerStats, source_graders
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import local_refs
from proctor.server.logs import configure_logging
from proctor.server.services.grader_role import LEASE_S, ROWS_PER_DISPATCH
from proctor.server.settings import default_workers
from proctor.wire.dataserver import Graders

__all__ = ["GradeWorkerOptions", "grade", "grade_worker", "server_graders"]

log = logging.getLogger("proctor.grade_worker")


@dataclass(frozen=True)
class GradeWorkerOptions:
    """One grade-worker: the dataserver it grades for, and how (``proctor grade-worker``'s options)."""

    server: str
    api_key: str | None = None
    processes: int | None = None  # grader processes; None: one per core
    rows_per_dispatch: int = ROWS_PER_DISPATCH
    tables_per_dispatch: int = TABLES_PER_DISPATCH
    lease_s: float = LEASE_S
    connect_timeout_s: float = 60.0
    exit_when_idle_s: float | None = None
    judge_api_key: SecretStr | None = None  # the curriculum's LLM judges' (GET /graders never sends it)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GradeWorkerOptions:
        judge_key = os.environ.get("PROCTOR_JUDGE_API_KEY")
        return cls(
            server=args.server,
            api_key=args.api_key or os.environ.get("PROCTOR_API_KEY"),
            judge_api_key=SecretStr(judge_key) if judge_key else None,
            processes=args.workers,
            rows_per_dispatch=args.rows_per_dispatch,
            tables_per_dispatch=args.tables_per_dispatch,
            lease_s=args.lease_s,
            connect_timeout_s=args.connect_timeout_s,
            exit_when_idle_s=args.exit_when_idle_s,
        )


def grade_worker(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "text")
    options = GradeWorkerOptions.from_args(args)
    if args.ray_actors is not None:
        try:
            from proctor.cli.ray_workers import serve_on_ray
        except ImportError as exc:
            if exc.name != "ray":
                raise
            print("proctor grade-worker: --ray-actors needs the ray extra: pip install 'proctor[ray]'")
            return 2
        return serve_on_ray(options, args.ray_actors, address=args.ray_address)
    try:
        asyncio.run(_until_signalled(options))
    except ValueError as exc:
        print(f"proctor grade-worker: {exc}")
        return 2
    return 0


async def _until_signalled(options: GradeWorkerOptions) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping(sig: signal.Signals) -> None:
        log.info("%s: stopping once the rows it holds are graded and collected", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping, sig)
    await grade(options, stop)


def server_graders(client: ProctorClient, timeout_s: float) -> Graders:
    """The graders the server names (``GET /graders``) once it answers, waiting up to ``timeout_s`` in all. A
    server that goes away between answering ``/healthz`` and answering this (it restarts) is waited for again,
    as the worker waits for it later, rather than ending the worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        client.wait_ready(timeout=max(0.0, deadline - time.monotonic()))
        try:
            return client.graders()
        except (TransportError, ServerFailure) as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("the dataserver did not answer GET /graders (%s); waiting for it again", exc)


async def grade(options: GradeWorkerOptions, stop: asyncio.Event) -> WorkerStats:
    """Grade the server's rows until ``stop`` is set (or, with ``exit_when_idle_s``, until none came for that
    long). Raises ``ValueError`` when the server names graders this machine cannot import."""
    client = ProctorClient(options.server, api_key=options.api_key, retries=2)
    try:
        spec = await asyncio.to_thread(server_graders, client, options.connect_timeout_s)
        graders = source_graders(spec)
        processes = options.processes or default_workers()
        pool = GraderPool(processes, graders=local_refs(graders))
        await pool.start()
        log.info("grading for %s with %d grader processes", options.server, processes)
        if options.judge_api_key is None and any(s.judges for s in spec.sources.values()):
            log.info("the curriculum's judges are called without an API key: PROCTOR_JUDGE_API_KEY is not set here")
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False) as http:
                worker = GradeWorker(
                    ExperienceClient(client=client),
                    graders,
                    pool,
                    http,
                    timeout_s=spec.timeout_s,
                    rows_per_dispatch=options.rows_per_dispatch,
                    tables_per_dispatch=options.tables_per_dispatch,
                    lease_s=options.lease_s,
                    transient=(TransportError, NotReadyError, ServerFailure),
                    judge_api_key=options.judge_api_key,
                )
                stats = await worker.run(stop, idle_exit_s=options.exit_when_idle_s)
        finally:
            await pool.close()
    finally:
        client.close()
    log.info(
        "stopped: %d rows graded, %d results refused (lease ended), server unreachable %d times",
        stats.graded,
        stats.refused,
        stats.unreachable,
    )
    return stats
