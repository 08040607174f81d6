"""GET /meta, GET /curriculum, GET /dashboard and GET /stats/{iteration}: what the server serves, where the
curriculum stands, and what it counted of each step."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from proctor.server.deps import DataserverDep
from proctor.server.errors import error_responses
from proctor.wire.dataserver import MAX_ITERATION, CurriculumState, Dashboard, Meta, StepStats

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


@router.get("/stats/{iteration}", responses=error_responses(404, 422))
async def read_step_stats(
    server: DataserverDep,
    iteration: Annotated[int, Path(ge=0, le=MAX_ITERATION, description="The generation step.")],
) -> StepStats:
    """A step's groups (one prompt's graded completions: count, mean and spread of the rewards) and their
    records' state as the adaptive samplers read it. They join ``proctor export``'s rows on ``(iteration,
    slot)`` and ``sample_id``; a 404 for a step that was never sampled and has no grades."""
    return await server.step_stats(iteration)
