"""The FastAPI application factory."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from proctor.experience.database import is_postgresql
from proctor.server import __version__
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.dataserver import Dataserver
from proctor.server.errors import error_responses, install_error_handlers
from proctor.server.handle import DataserverHandle
from proctor.server.metrics import Metrics
from proctor.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ForwardingMiddleware,
    JsonBodyMiddleware,
    RequestMetricsMiddleware,
)
from proctor.server.openapi import complete_openapi
from proctor.server.routes import curriculum, experience, grade, ops, page, peers, refill, replica, sample
from proctor.server.services.standby_grading import Serving, StandbyGrading
from proctor.server.settings import Settings
from proctor.server.store import Standby, redacted

__all__ = ["create_app"]

log = logging.getLogger("proctor")

_GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections
_REOPEN_EVERY_S = 1.0  # how often a server whose PostgreSQL database failed tries to open it again


def create_app(settings: Settings, *, curriculum_obj: Curriculum | None = None) -> FastAPI:
    """Build the dataserver app for ``settings``.

    The curriculum is loaded here, so a broken curriculum fails before a port is bound. The lifespan opens the
    state file, restores the curriculum state and starts the grader processes; it stops them on shutdown.
    Its start-up also sets the process's garbage collector: what start-up allocated is frozen, and the young
    generation is collected every ``_GC_YOUNG_THRESHOLD`` allocations rather than Python's 700. Pass
    ``curriculum_obj`` to reuse an already loaded curriculum.
    """
    cur = curriculum_obj or load_curriculum(settings.curriculum, seed=settings.seed)
    metrics = Metrics()

    path = settings.state_path(cur.name, cur.hash)

    def standby() -> Standby:
        return Standby(path, curriculum=cur.name, curriculum_hash=cur.hash, seed=cur.seed)

    async def standby_grading(serving: Serving, unreachable: Callable[[], None]) -> StandbyGrading:
        return await StandbyGrading.start(cur, settings, metrics, path, serving, unreachable)

    # A standby grades the /grade requests it can place on grader processes of its own; without local grader
    # processes (PROCTOR_GRADER_WORKERS=0) grade-workers grade for the serving server, and /grade goes there.
    postgresql = is_postgresql(path)
    grades_standing_by = postgresql and settings.grader_workers > 0

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        handle = await DataserverHandle.start(
            lambda: Dataserver.open(cur, settings, metrics),
            retry_s=_REOPEN_EVERY_S,
            standby=standby if postgresql else None,
            metrics=metrics,
            grading=standby_grading if grades_standing_by else None,
        )
        # Everything allocated so far lives as long as the server: keep it out of the collector's full
        # passes, which otherwise walk it on every gen-2 collection and show up as latency spikes.
        gc.freeze()
        # What the run keeps from then on (each kept step's table, the served batches) is long-lived too, and
        # with the default young threshold (700) a request's short-lived objects are collected and promoted so
        # often that full passes over that state follow every few hundred requests: tens of ms each under load.
        # Process-wide, like the freeze, and left so at shutdown (servers of one process share it).
        gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        state = redacted(path)
        log.info(
            "%s curriculum %r (hash %s, seed %d) from %s; run %r, state %s (%s); %d grader processes",
            "serving" if handle.serving else "standing by for",
            cur.name,
            cur.hash,
            cur.seed,
            cur.path,
            settings.run_name(cur.name, cur.hash),
            state,
            _resumed(handle),
            settings.grader_workers,
        )
        try:
            yield {"dataserver": handle, "metrics": metrics}
        finally:
            await handle.close()
            log.info("stopped: grader processes ended, state %s closed", state)

    locked = settings.api_key is not None
    app = FastAPI(
        title="proctor",
        summary="Curriculum dataserver for RL post-training: staged prompts out, graded completions in.",
        version=__version__,
        lifespan=lifespan,
        # With an API key the schema is served behind it too, and the browser UIs (which cannot send the key
        # when they fetch the schema) are off.
        docs_url=None if locked else "/docs",
        redoc_url=None if locked else "/redoc",
    )
    install_error_handlers(app)
    # With a key, every route but the open ones (the health router's) may answer 401.
    keyed = error_responses(401) if locked else {}
    app.include_router(ops.health_router)
    app.include_router(ops.metrics_router, responses=keyed)
    app.include_router(curriculum.router, responses=keyed)
    app.include_router(sample.router, responses=keyed)
    app.include_router(refill.router, responses=keyed)
    app.include_router(grade.router, responses=keyed)
    app.include_router(peers.router, responses=keyed)
    app.include_router(experience.router, responses=keyed)
    app.include_router(replica.router)
    # The live page at `/`: static files, open like the health route (the page sends the key for its data).
    app.include_router(page.router)
    open_paths = ops.OPEN_PATHS | page.OPEN_PATHS
    limits = {
        ("SampleRequest", "batch_size"): {"maximum": settings.max_batch_size},
        ("GradeRequest", "items"): {"maxItems": settings.max_grade_items},
        ("GradeItem", "completion"): {"maxLength": settings.max_completion_chars},
    }
    complete_openapi(app, bearer=locked, limits=limits, open_paths=open_paths)
    # Each add wraps the ones before: the request passes metrics, then the key, the body's type and its size
    # limit, all of which look at the head only, before the route reads the body.
    # Innermost: a standby forwards a request once the others have let it in (key, type, size).
    app.add_middleware(ForwardingMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(JsonBodyMiddleware)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value(), open_paths=open_paths)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app


def _resumed(handle: DataserverHandle) -> str:
    if not handle.serving:
        return "held by another server"
    last = handle.get().last_iteration
    return "new" if last is None else f"resumed after iteration {last}; --fresh starts the run over"
