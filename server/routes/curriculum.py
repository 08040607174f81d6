"""GET /meta, GET /curriculum and GET /dashboard: what the server serves and where the curriculum stands."""

from __future__ import annotations

from fastapi import APIRouter

from proctor.server.deps import DataserverDep
from proctor.server.protocol import CurriculumState, Dashboard, Meta

router = APIRouter(tags=["curriculum"])


@router.get("/meta")
async def read_meta(server: DataserverDep) -> Meta:
    """Stages with their ``until_step``, total iterations, seed, curriculum hash and sources."""
    return server.meta()


@router.get("/curriculum")
async def read_curriculum(server: DataserverDep) -> CurriculumState:
    """The live state: current stage, every transition with its iteration and reason, per-stage counts."""
    return server.curriculum_state()


@router.get("/dashboard")
async def read_dashboard(server: DataserverDep) -> Dashboard:
    """What the live page at ``/`` draws: stages and transitions, the latest iterations' rewards and
    zero-variance groups, each source's pass-rate histogram, and the latest grader errors."""
    return server.dashboard()
