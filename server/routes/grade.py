"""POST /grade: rewards for completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from proctor.server.deps import DataserverDep
from proctor.server.protocol import GradeRequest, GradeResponse

router = APIRouter(tags=["data"])


@router.post("/grade", responses={422: {"description": "An item is malformed (the detail names it)."}})
async def create_grades(body: GradeRequest, server: DataserverDep, request: Request) -> GradeResponse:
    """Grade completions; results are matched by ``(sample_id, completion_index)``, never by position.

    Posting the same completion again returns the stored result and does not count twice.
    """
    if body.iteration is not None:
        request.state.iteration = body.iteration
    return await server.grade(body)
