"""The server's exception hierarchy, with no web framework import: the store, the curriculum spec and the
settings raise from here without loading FastAPI.

Every error the server raises derives from ``ProctorError`` (``proctor.errors``, the root the client's and the
experience store's errors share). ``RequestError`` and its subclasses carry a message for the client; the HTTP
layer (``proctor.server.errors``) chooses each one's status and turns it into an answer. The others are
configuration or data errors raised at start-up or by ``proctor validate`` (each also derives from the built-in
class its callers catch, e.g. ``CurriculumError`` is a ``ValueError``).
"""

from __future__ import annotations

from proctor.errors import ProctorError

__all__ = [
    "ConflictError",
    "ForbiddenError",
    "InvalidRequestError",
    "NotFoundError",
    "ProctorError",
    "RelayedError",
    "RequestError",
    "UnavailableError",
]


class RequestError(ProctorError):
    """A request the server refuses, with a message for the client; ``code``, when set, names the error's class
    for a client that raises it again (the experience store's errors)."""

    code: str | None = None

    def __init__(self, detail: str, *, code: str | None = None) -> None:
        self.detail = detail
        if code is not None:
            self.code = code
        super().__init__(detail)


class InvalidRequestError(RequestError):
    """A well-formed request whose values the server cannot accept."""

    def __init__(self, field: str, message: str, *, code: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}", code=code)


class ForbiddenError(RequestError):
    """A request its sender may not make, whatever its values."""


class NotFoundError(RequestError):
    """A request for something the server does not have."""


class ConflictError(RequestError):
    """A request that contradicts what the server already recorded."""


class UnavailableError(RequestError):
    """The server cannot serve safely any more, e.g. its state file stopped accepting writes."""


class RelayedError(RequestError):
    """Another server's refusal, passed on as it answered: a standby's request to the server that serves its
    database was refused with ``status``."""

    def __init__(self, status: int, detail: str, *, code: str | None = None) -> None:
        self.status = status
        super().__init__(detail, code=code)
