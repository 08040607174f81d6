"""POST /grade: rewards for completions."""

from __future__ import annotations

from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, Request, Response

from proctor.server.deps import DataserverDep, json_body
from proctor.server.errors import error_responses
from proctor.server.exceptions import UnavailableError
from proctor.server.handle import DataserverHandle
from proctor.server.middleware import FORWARDED, HOP_BY_HOP
from proctor.server.openapi import request_body
from proctor.server.services import views
from proctor.server.services.standby_grading import ServedElsewhere
from proctor.wire.dataserver import GradeRequest, GradeResponse, Graders

router = APIRouter(tags=["data"])
GradeRequestBody = Annotated[GradeRequest, Depends(json_body(GradeRequest))]


@router.post(
    "/grade",
    response_model=GradeResponse,
    openapi_extra=request_body(GradeRequest),
    responses=error_responses(400, 413, 415, 422, 503),
)
async def create_grades(body: GradeRequestBody, request: Request) -> Response:
    """Grade completions; results are matched by ``(slot, completion_index)`` (or ``(sample_id,
    completion_index)`` for items without a slot), never by position.

    Posting the same completion again returns the stored result and does not count twice.
    """
    if body.iteration is not None:
        request.state.iteration = body.iteration
    handle: DataserverHandle = request.state.dataserver
    standby = handle.standby_grading()
    if standby is None:
        graded = await handle.get().grading.grade(body)
    else:
        try:
            graded = await standby.grade(body)
        except ServedElsewhere:
            return await _forwarded(request, handle)
    # Serialised here, once: returning the model would make FastAPI validate it again on the way out.
    return Response(graded.model_dump_json(), media_type="application/json")


async def _forwarded(request: Request, handle: DataserverHandle) -> Response:
    """The serving server's answer to ``request``, which this standby cannot place."""
    target = handle.forward_target()
    if target is None:
        raise UnavailableError("this server stands by and no serving server is known yet; retry")
    headers = [(k, v) for k, v in request.headers.raw if k not in HOP_BY_HOP] + [(FORWARDED, b"1")]
    try:
        url = target.rstrip("/") + "/grade"
        answer = await handle.forwarder.post(url, content=await request.body(), headers=headers)
    except httpx.TransportError as exc:
        handle.serving_unreachable()
        raise UnavailableError(
            f"this server stands by, and the serving one at {target} does not answer ({type(exc).__name__}); "
            "a standby takes over within seconds: retry"
        ) from None
    kept = [(k, v) for k, v in answer.headers.raw if k.lower() not in HOP_BY_HOP and k.lower() != b"content-length"]
    out = Response(answer.content, status_code=answer.status_code)
    out.raw_headers = [*kept, (b"content-length", str(len(answer.content)).encode())]
    return out


@router.get("/graders", response_model=Graders)
async def get_graders(server: DataserverDep) -> Graders:
    """Each source's graders as this server resolved them: what a ``proctor grade-worker`` runs. Custom
    graders must be importable on the worker's machine under the same reference."""
    return views.graders(server.ctx.curriculum, server.ctx.settings)
