"""Domain errors that routes raise, and the handlers that turn every client error into a 4xx with a
``detail`` naming the field and the fix."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

__all__ = [
    "ConflictError",
    "InvalidRequestError",
    "ProctorError",
    "UnavailableError",
    "install_error_handlers",
]


class ProctorError(Exception):
    """An error with an HTTP status and a message for the client."""

    status_code = 400

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class InvalidRequestError(ProctorError):
    """A well-formed request whose values the server cannot accept (422)."""

    status_code = 422

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ConflictError(ProctorError):
    """A request that contradicts what the server already recorded (409)."""

    status_code = 409


class UnavailableError(ProctorError):
    """The server cannot serve safely any more, e.g. its state file stopped accepting writes (503)."""

    status_code = 503


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProctorError)
    async def _proctor_error(request: Request, exc: ProctorError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        # A body that is not JSON at all is a 400; JSON with wrong fields is a 422.
        if any(e.get("type") == "json_invalid" for e in errors):
            err = next(e for e in errors if e.get("type") == "json_invalid")
            reason = (err.get("ctx") or {}).get("error", "invalid JSON")
            return JSONResponse(
                {"detail": f"body: malformed JSON ({reason}); send a JSON object with Content-Type application/json"},
                status_code=400,
            )
        messages = []
        for e in errors:
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            messages.append(f"{_field(e.get('loc', ()))}: {msg}")
        detail = "; ".join(messages)
        simple = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        return JSONResponse({"detail": detail, "errors": simple}, status_code=422)
