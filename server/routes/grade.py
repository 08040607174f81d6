"""POST /grade: rewards for completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from proctor.server.deps import DataserverDep
from proctor.server.protocol import GradeRequest, GradeResponse

router = APIRouter(tags=["data"])


@router.post(
    "/grade",
    response_model=GradeResponse,
    responses={422: {"description": "An item is malformed (the detail names it)."}},
)
async def create_grades(body: GradeRequest, server: DataserverDep, request: Request) -> Response:
    """Grade completions; results are matched by ``(sample_id, completion_index)``, never by position.

    Posting the same completion again returns the stored result and does not count twice.
    """
    if body.iteration is not None:
        request.state.iteration = body.iteration
    # Serialised here, once: returning the model would make FastAPI validate it again on the way out.
    return Response((await server.grade(body)).model_dump_json(), media_type="application/json")
