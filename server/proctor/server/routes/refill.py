"""POST /refill: which groups of a graded generation step to replace, and the prompts that replace them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from proctor.server.deps import DataserverDep, json_body
from proctor.server.errors import error_responses
from proctor.server.openapi import request_body
from proctor.wire.dataserver import RefillRequest, RefillResponse

router = APIRouter(tags=["data"])
RefillRequestBody = Annotated[RefillRequest, Depends(json_body(RefillRequest))]


@router.post(
    "/refill",
    response_model=RefillResponse,
    openapi_extra=request_body(RefillRequest),
    responses=error_responses(400, 409, 413, 415, 422, 503),
)
async def create_refill(body: RefillRequestBody, server: DataserverDep, request: Request) -> RefillResponse:
    """Refill round ``round`` of ``iteration``: the groups the stage's ``refill`` rule does not keep, each with
    a record of its source that replaces it in a new slot.

    Decided once, from the grades the server stored, when the first request for the round comes (every group
    the round looks at must be graded by then); every later request for it (a retry, another rank, after a
    restart) gets the same answer. Round 1 looks at every group of the step, each later round at the groups the
    round before put in. Completions of a replacement are graded with ``/grade``, at its new slot.
    """
    request.state.iteration = body.iteration
    return await server.refills.refill(body)
