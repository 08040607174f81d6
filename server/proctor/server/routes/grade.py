"""POST /grade: rewards for completions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from proctor.server.deps import DataserverDep, GradingDep, json_body
from proctor.server.errors import error_responses
from proctor.server.openapi import request_body
from proctor.server.services import views
from proctor.wire.dataserver import GradeRequest, GradeResponse, Graders

router = APIRouter(tags=["data"])
GradeRequestBody = Annotated[GradeRequest, Depends(json_body(GradeRequest))]


@router.post(
    "/grade",
    response_model=GradeResponse,
    openapi_extra=request_body(GradeRequest),
    responses=error_responses(400, 413, 415, 422, 503),
)
async def create_grades(body: GradeRequestBody, grading: GradingDep, request: Request) -> Response:
    """Grade completions; results are matched by ``(slot, completion_index)`` (or ``(sample_id,
    completion_index)`` for items without a slot), never by position.

    Posting the same completion again returns the stored result and does not count twice.
    """
    if body.iteration is not None:
        request.state.iteration = body.iteration
    # Serialised here, once: returning the model would make FastAPI validate it again on the way out.
    return Response((await grading.grade(body)).model_dump_json(), media_type="application/json")


@router.get("/graders", response_model=Graders)
async def get_graders(server: DataserverDep) -> Graders:
    """Each source's graders as this server resolved them: what a ``proctor grade-worker`` runs. Custom
    graders must be importable on the worker's machine under the same reference."""
    return views.graders(server.ctx.curriculum, server.ctx.settings)
