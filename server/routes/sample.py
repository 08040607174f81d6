"""POST /sample: the prompts of one GRPO generation step."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from proctor.server.deps import DataserverDep
from proctor.server.protocol import SampleRequest, SampleResponse

router = APIRouter(tags=["data"])

_ERRORS: dict[int | str, dict[str, str]] = {
    409: {"description": "The iteration was already sampled with another batch_size."},
    422: {"description": "A field is out of range (the detail names it)."},
}


@router.post("/sample", response_model=SampleResponse, responses=_ERRORS)
async def create_sample(body: SampleRequest, server: DataserverDep, request: Request) -> Response:
    """The batch of prompts for ``iteration`` (or this rank's contiguous share of it).

    The first request for an iteration fixes its batch; every later request for it (a retry, another rank,
    after a restart) gets the same samples.
    """
    request.state.iteration = body.iteration
    # Already JSON (see Dataserver.sample); `response_model` documents its shape.
    return Response(await server.sample(body), media_type="application/json")
