"""The serving server's side of a standby's ``/grade`` (:mod:`proctor.server.services.standby_grading`): the
completions a standby of its PostgreSQL database graded, written to this server's experience store, and the
rewards of rows another holder of the grader role held. Not part of the API: only a standby that read the
serving token from the database may call them."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request, Response

from proctor.server.deps import DataserverDep
from proctor.server.exceptions import ForbiddenError, InvalidRequestError, UnavailableError
from proctor.server.services.grader_role import grading_time
from proctor.server.services.standby_grading import (
    TOKEN_HEADER,
    decode_graded,
    decode_rewards_wait,
    encode_rewards,
    encode_written,
)

router = APIRouter(include_in_schema=False)


def _check_token(request: Request, expected: str | None) -> None:
    given = request.headers.get(TOKEN_HEADER)
    if given is None:
        raise ForbiddenError(f"{TOKEN_HEADER}: missing; this route is for the standbys of this server's database")
    if expected is None or not secrets.compare_digest(given, expected):
        # A standby that has not seen yet that another server serves the database now.
        raise UnavailableError(f"{TOKEN_HEADER}: not this server's; the serving server changed, retry")


@router.post("/replica/graded")
async def write_graded(request: Request, server: DataserverDep) -> Response:
    _check_token(request, server.peer_token)
    graded, lease_s = decode_graded(await request.body(), server.ctx.curriculum)
    limit = server.ctx.settings.max_grade_items
    if len(graded) > limit:
        raise InvalidRequestError("items", f"{len(graded)} items is above this server's maximum of {limit}")
    written = await server.rollouts.write_graded(graded, lease_s=min(max(lease_s, 1.0), 3600.0))
    return Response(encode_written(written), media_type="application/json")


@router.post("/replica/rewards")
async def rewards(request: Request, server: DataserverDep) -> Response:
    _check_token(request, server.peer_token)
    table, rows, timeout_s, written_now = decode_rewards_wait(await request.body())
    s = server.ctx.settings
    if len(rows) > s.max_grade_items:
        raise InvalidRequestError("rows", f"{len(rows)} rows is above this server's maximum of {s.max_grade_items}")
    longest = grading_time(s.max_grade_items, max(s.grader_workers, 1), s.grader_timeout_s)
    values = await server.rollouts.rewards(table, rows, min(max(timeout_s, 0.0), longest), written_now=written_now)
    return Response(encode_rewards(values), media_type="application/json")
