"""POST /score, and the reward-server protocols of other trainers mapped onto it: OpenRLHF's and slime's."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel

from proctor.server.deps import DataserverDep, json_body
from proctor.server.errors import error_responses
from proctor.server.openapi import request_body
from proctor.server.services.scoring import response_of
from proctor.wire.peers import (
    OpenRLHFRewardRequest,
    OpenRLHFRewardResponse,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
    SlimeRewardRequest,
)

router = APIRouter(tags=["grading"])
ScoreBody = Annotated[ScoreRequest, Depends(json_body(ScoreRequest))]
OpenRLHFBody = Annotated[OpenRLHFRewardRequest, Depends(json_body(OpenRLHFRewardRequest))]
SlimeBody = Annotated[SlimeRewardRequest, Depends(json_body(SlimeRewardRequest))]
_ERRORS = error_responses(400, 413, 415, 422, 503)


@router.post("/score", response_model=ScoreResponse, openapi_extra=request_body(ScoreRequest), responses=_ERRORS)
async def score(body: ScoreBody, server: DataserverDep) -> Response:
    """Rewards for completions named by label: a sample id names the record (graded like ``/grade`` without
    ``iteration``, and stored); any other label is the reference answer for the default source's graders
    (``PROCTOR_PEER_DEFAULT_SOURCE``)."""
    # Serialised here, once: returning the model would make FastAPI validate it again on the way out.
    return _json(ScoreResponse(results=await server.scoring.score(body.items)))


@router.post(
    "/openrlhf/reward",
    response_model=OpenRLHFRewardResponse,
    openapi_extra=request_body(OpenRLHFRewardRequest),
    responses=_ERRORS,
)
async def openrlhf_reward(body: OpenRLHFBody, server: DataserverDep) -> Response:
    """OpenRLHF's remote reward model (``--reward.remote_url http://HOST:PORT/openrlhf/reward``): each query is
    the prompt and the response decoded together; the response is what follows the prompt, without the special
    tokens that end it. Labels are read as by ``/score``."""
    prompts: list[str | None] = list(body.prompts) if body.prompts is not None else [None] * len(body.query)
    labels = body.labels if body.labels is not None else [None] * len(body.query)
    # Off the event loop: a query that does not start with its prompt is matched character by character.
    responses = await asyncio.to_thread(lambda: [response_of(q, p) for q, p in zip(body.query, prompts, strict=True)])
    items = [
        ScoreItem(response=r, label=_text(label), prompt=p)
        for r, p, label in zip(responses, prompts, labels, strict=True)
    ]
    results = await server.scoring.score(
        items, lambda field, n: f"query[{n}]" if field == "response" else f"labels[{n}]"
    )
    rewards = [r.reward for r in results]
    shared = set.intersection(*(set(r.components) for r in results))
    logs = {name: [r.components[name] for r in results] for name in sorted(shared)}
    logs["grading_errors"] = [float(r.error is not None) for r in results]
    return _json(OpenRLHFRewardResponse(rewards=rewards, scores=rewards, extra_logs=logs))


@router.post("/slime/reward", response_model=float, openapi_extra=request_body(SlimeRewardRequest), responses=_ERRORS)
async def slime_reward(body: SlimeBody, server: DataserverDep) -> float:
    """slime's remote reward model (``--rm-type remote_rm --rm-url http://HOST:PORT/slime/reward``): the reward
    of one response, a bare number. Labels are read as by ``/score``."""
    prompt = body.prompt if isinstance(body.prompt, str) else None
    item = ScoreItem(response=body.response, label=_text(body.label), prompt=prompt)
    [result] = await server.scoring.score([item], lambda field, _: field)
    return result.reward


def _text(label: str | float | None) -> str | None:
    """A label as text; an empty one names nothing."""
    return None if label is None or label == "" else str(label)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
