"""GET /healthz and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proctor.server.deps import DataserverDep, MetricsDep
from proctor.server.errors import error_responses
from proctor.wire.dataserver import Health

health_router = APIRouter(tags=["ops"])
# The paths of health_router: open without the API key, so that an orchestrator can probe the server.
OPEN_PATHS = frozenset({"/healthz"})
metrics_router = APIRouter(tags=["ops"])


@health_router.get("/healthz", responses=error_responses(503))
async def read_health(server: DataserverDep) -> Health:
    """Liveness: answers from memory, without touching the store or the graders; 503 once the state has
    refused a write (a state file's server then refuses work until it is restarted; a PostgreSQL database's
    opens it again by itself once it answers)."""
    server.ctx.storage.check_healthy()
    return Health(status="ok", curriculum=server.ctx.curriculum.name, last_iteration=server.last_iteration)


@metrics_router.get("/metrics", response_class=Response)
async def read_metrics(metrics: MetricsDep) -> Response:
    """Prometheus text exposition of this process's metrics: a standby's are its own (``proctor_serving`` 0), and
    they answer while the state is opened again."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
