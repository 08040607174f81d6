"""POST /sample: the prompts of one GRPO generation step."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from proctor.server.deps import DataserverDep, json_body
from proctor.server.errors import error_responses
from proctor.server.openapi import request_body
from proctor.wire.dataserver import SampleRequest, SampleResponse

router = APIRouter(tags=["data"])
SampleRequestBody = Annotated[SampleRequest, Depends(json_body(SampleRequest))]


@router.post(
    "/sample",
    response_model=SampleResponse,
    openapi_extra=request_body(SampleRequest),
    responses=error_responses(400, 409, 413, 415, 422, 503),
)
async def create_sample(body: SampleRequestBody, server: DataserverDep, request: Request) -> Response:
    """The batch of prompts for ``iteration`` (or this rank's contiguous share of it).

    The first request for an iteration fixes its batch; every later request for it (a retry, another rank,
    after a restart) gets the same samples. The step's table in the experience store (``GET
    /experience/tables/{iteration}``) is opened with each slot's prompt.
    """
    request.state.iteration = body.iteration
    # Already JSON (see SamplingService.sample); `response_model` documents its shape.
    return Response(await server.rollouts.sample(body), media_type="application/json")
