"""The handlers that turn every client error into a 4xx with a ``detail`` naming the field and the fix, and the
error bodies of the OpenAPI description. The errors routes raise are defined in ``proctor.server.exceptions``
(no FastAPI there)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from proctor.server.exceptions import (
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    RelayedError,
    RequestError,
    UnavailableError,
)

__all__ = [
    "ErrorBody",
    "ValidationErrorBody",
    "ValidationIssue",
    "error_responses",
    "install_error_handlers",
    "status_of",
]

# The one place a refused request's class becomes an HTTP status; a subclass answers as its nearest listed base.
_STATUS: dict[type[RequestError], int] = {
    RequestError: 400,
    InvalidRequestError: 422,
    ForbiddenError: 403,
    NotFoundError: 404,
    ConflictError: 409,
    UnavailableError: 503,
}


def status_of(error: RequestError) -> int:
    """The HTTP status that answers ``error``."""
    if isinstance(error, RelayedError):
        return error.status
    return next(_STATUS[cls] for cls in type(error).__mro__ if cls in _STATUS)


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer: what went wrong, naming the field or header, and what to do."""

    detail: str
    code: str | None = Field(default=None, description="The error's class, on /experience answers.")


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(ErrorBody):
    """A 422: ``detail`` says it in one line; ``errors`` lists each problem with its location."""

    errors: list[ValidationIssue] = []


# The error answers a route may give, for its OpenAPI description; routes pick theirs with `error_responses`.
_ERROR_RESPONSES: dict[int, tuple[type[BaseModel], str]] = {
    400: (ErrorBody, "The body is not JSON, or Content-Length is not a number."),
    401: (ErrorBody, "The server has an API key and the request's bearer token is missing or wrong."),
    404: (ErrorBody, "The experience store has no such table or consumer (the detail says why)."),
    409: (ErrorBody, "The request contradicts what the server recorded (the detail says what to send)."),
    413: (ErrorBody, "The body is larger than PROCTOR_MAX_BODY_BYTES."),
    415: (ErrorBody, "The body is not declared as JSON (Content-Type: application/json)."),
    422: (ValidationErrorBody, "A field is missing, of the wrong type or out of range (the detail names it)."),
    503: (
        ErrorBody,
        "The server cannot serve safely: its state refused a write (a state file's server needs a restart; a "
        "PostgreSQL database's reconnects by itself), or it stands by for a server that does not answer (another "
        "takes over within seconds). Retry.",
    ),
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route or router: the listed error answers with their body schema."""
    return {code: {"model": _ERROR_RESPONSES[code][0], "description": _ERROR_RESPONSES[code][1]} for code in codes}


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _got(value: Any) -> str:
    """A short JSON rendering of a value a client sent, for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(error: Mapping[str, Any]) -> str:
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    # Type and range errors say what was sent; value errors (ours) already do, and a missing field has no input.
    if error.get("type") not in ("missing", "value_error") and "input" in error:
        if error.get("type") in ("int_type", "int_parsing", "int_from_float"):
            msg = "Input should be a JSON integer"
        msg += f"; got {_got(error['input'])}"
    return msg


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        body = {"detail": exc.detail} if exc.code is None else {"detail": exc.detail, "code": exc.code}
        return JSONResponse(body, status_code=status_of(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        # A body that is not JSON at all is a 400; JSON with wrong fields is a 422.
        if any(e.get("type") == "json_invalid" for e in errors):
            err = next(e for e in errors if e.get("type") == "json_invalid")
            reason = str((err.get("ctx") or {}).get("error", "invalid JSON"))
            if "hex escape" in reason:
                # The parser's words for a \uXXXX escape of half a UTF-16 pair, which is no character at all.
                reason += "; a lone UTF-16 surrogate (\\ud800 to \\udfff) is not valid text"
            return JSONResponse(
                {"detail": f"body: malformed JSON ({reason}); send a JSON object with Content-Type application/json"},
                status_code=400,
            )
        detail = "; ".join(f"{_field(e.get('loc', ()))}: {_message(e)}" for e in errors)
        simple = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        return JSONResponse({"detail": detail, "errors": simple}, status_code=422)
