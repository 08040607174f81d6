"""The server's exception hierarchy, with no web framework import: the store, the curriculum spec and the
settings raise from here without loading FastAPI.

Every error the server raises derives from ``ProctorError``. ``RequestError`` and its subclasses carry an HTTP
status and a message for the client; ``proctor.server.errors`` turns them into answers. The others are
configuration or data errors raised at start-up or by ``proctor validate`` (each also derives from the built-in
class its callers catch, e.g. ``CurriculumError`` is a ``ValueError``).
"""

from __future__ import annotations

__all__ = ["ConflictError", "InvalidRequestError", "NotFoundError", "ProctorError", "RequestError", "UnavailableError"]


class ProctorError(Exception):
    """Every error the server raises."""


class RequestError(ProctorError):
    """An error with an HTTP status and a message for the client; ``code``, when set, names the error's class
    for a client that raises it again (the experience store's errors)."""

    status_code = 400
    code: str | None = None

    def __init__(self, detail: str, *, status_code: int | None = None, code: str | None = None) -> None:
        self.detail = detail
        if status_code is not None:
            self.status_code = status_code
        if code is not None:
            self.code = code
        super().__init__(detail)


class InvalidRequestError(RequestError):
    """A well-formed request whose values the server cannot accept (422)."""

    status_code = 422

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class NotFoundError(RequestError):
    """A request for something the server does not have (404)."""

    status_code = 404


class ConflictError(RequestError):
    """A request that contradicts what the server already recorded (409)."""

    status_code = 409


class UnavailableError(RequestError):
    """The server cannot serve safely any more, e.g. its state file stopped accepting writes (503)."""

    status_code = 503
