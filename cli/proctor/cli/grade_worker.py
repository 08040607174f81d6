"""``proctor grade-worker``: the grader role of a dataserver's experience store, on this machine.

Needs the ``server`` extra (the graders) and the client (the store over HTTP). Custom graders must be
importable here under the references the server resolved (``GET /graders``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Mapping

import httpx

from proctor.client.errors import NotReadyError, ServerFailure, TransportError
from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.server.grade_worker import GradeWorker, source_graders
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import SourceGraders
from proctor.server.logs import configure_logging
from proctor.server.settings import default_workers

__all__ = ["grade_worker"]

log = logging.getLogger("proctor.grade_worker")


def grade_worker(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, "text")
    client = ProctorClient(args.server, api_key=args.api_key or os.environ.get("PROCTOR_API_KEY"), retries=2)
    try:
        client.wait_ready(timeout=args.connect_timeout_s)
        spec = client.graders()
        graders = source_graders(spec)
        return asyncio.run(_run(args, ExperienceClient(client=client), graders, spec.timeout_s))
    except ValueError as exc:
        print(f"proctor grade-worker: {exc}")
        return 2
    finally:
        client.close()


async def _run(
    args: argparse.Namespace, experience: ExperienceClient, graders: Mapping[str, SourceGraders], timeout_s: float
) -> int:
    processes = args.workers or default_workers()
    pool = GraderPool(processes)
    await pool.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("grading for %s with %d grader processes", args.server, processes)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False) as http:
            worker = GradeWorker(
                experience,
                graders,
                pool,
                http,
                timeout_s=timeout_s,
                rows_per_dispatch=args.rows_per_dispatch,
                lease_s=args.lease_s,
                transient=(TransportError, NotReadyError, ServerFailure),
            )
            stats = await worker.run(stop, idle_exit_s=args.exit_when_idle_s)
    finally:
        await pool.close()
    log.info(
        "stopped: %d rows graded, %d results refused (lease ended), server unreachable %d times",
        stats.graded,
        stats.refused,
        stats.unreachable,
    )
    return 0
