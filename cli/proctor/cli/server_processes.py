"""``proctor serve --workers N``: N server processes of one PostgreSQL database on one port.

Each process listens on the port (``SO_REUSEPORT``: the kernel spreads new connections over them) and on a port of
its own, which it advertises to the others (the serving one is reached there by the standbys, never through the
shared port, which might hand them to a standby). One of them serves the database and the others stand by
(:mod:`proctor.server.handle`): they forward requests to it, grade the ``/grade`` requests of sampled steps
themselves, and take over when it ends. This process starts them, starts another when one ends, and stops them
all on SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from urllib.parse import urlsplit

from proctor.server.logs import configure_logging
from proctor.server.settings import Settings

__all__ = ["supervise"]

log = logging.getLogger("proctor")

# A process that ends this soon after it started may end again at once (a database that refuses it, say): the
# next one waits, twice as long each time, up to _MOST_WAIT_S.
_STARTING_S = 15.0
_MOST_WAIT_S = 30.0
_LOOK_S = 0.5


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` server processes until SIGTERM or SIGINT, starting another for each that ends."""
    # Held while the processes come and go, so that the port stays this run's; bound, never listening, it is
    # handed no connection.
    holder = _bound(settings.host, settings.port)
    port = holder.getsockname()[1]
    update: dict[str, object] = {"port": port}
    if "grader_workers" not in settings.model_fields_set:
        # The default is a grader process per core for the whole server, not for each of its processes, which
        # share the cores (and each grader process's memory is a full interpreter's).
        update["grader_workers"] = max(1, settings.grader_workers // settings.workers)
    settings = settings.model_copy(update=update)
    spawn = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    def start(index: int) -> BaseProcess:
        process = spawn.Process(target=_serve_one, args=(settings,), name=f"proctor-serve-{index}")
        process.start()
        return process

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    processes = {n: start(n) for n in range(settings.workers)}
    started = dict.fromkeys(processes, time.monotonic())
    waits = dict.fromkeys(processes, 0.0)
    due: dict[int, float] = {}  # when each ended process is started again
    log.info("%d server processes on port %d", settings.workers, port)
    try:
        while not stopping:
            wait([p.sentinel for n, p in processes.items() if n not in due], timeout=_LOOK_S)
            now = time.monotonic()
            for n, process in processes.items():
                if stopping:
                    break
                if n in due:
                    if now >= due[n]:
                        del due[n]
                        processes[n], started[n] = start(n), now
                    continue
                if process.is_alive():
                    continue
                quick = now - started[n] < _STARTING_S
                waits[n] = min(max(2 * waits[n], 1.0), _MOST_WAIT_S) if quick else 0.0
                due[n] = now + waits[n]
                log.warning(
                    "server process %d ended with exit code %s: starting another%s",
                    n,
                    process.exitcode,
                    f" in {waits[n]:g} s" if waits[n] else "",
                )
    finally:
        for process in processes.values():
            if process.is_alive():
                process.terminate()  # uvicorn's graceful shutdown, then the lifespan's
        deadline = time.monotonic() + settings.shutdown_timeout_s + 30.0
        for process in processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        holder.close()
    return 0


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _serve_one(settings: Settings) -> None:
    """One server process: the shared port and a port of its own, which the others reach it at."""
    import uvicorn

    from proctor.server.app import create_app
    from proctor.server.connection import uvicorn_options

    configure_logging(settings.log_level, settings.log_format)
    shared = _bound(settings.host, settings.port)
    own = socket.socket(shared.family, socket.SOCK_STREAM)
    own.bind((settings.host, 0))
    advertised = urlsplit(settings.advertised_url())
    host = advertised.hostname or settings.host
    netloc = f"[{host}]" if ":" in host else host
    url = f"{advertised.scheme}://{netloc}:{own.getsockname()[1]}"
    settings = settings.model_copy(update={"advertise_url": url, "workers": 1})
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        **uvicorn_options(settings),
    )
    uvicorn.Server(config).run(sockets=[shared, own])
