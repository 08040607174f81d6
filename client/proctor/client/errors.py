"""Exceptions raised by :class:`proctor.client.ProctorClient`.

Every one carries the request that failed and, where the server answered, its ``detail``. They derive from
``proctor.errors.ProctorError``, as the experience store's errors (which ``ExperienceClient`` raises) do::

    ProctorError
    └── DataserverError
        ├── TransportError        the server could not be reached (after the retries)
        ├── NotReadyError         the server did not become ready in time
        └── ServerError           the server answered with an error status
            ├── RequestRejected   4xx: the request is wrong; retrying will not help
            │   ├── Unauthorized  401: missing or wrong API key
            │   └── Conflict      409: contradicts what the server recorded (e.g. another batch_size)
            └── ServerFailure     5xx, or 429 (overloaded), after the retries
"""

from __future__ import annotations

import httpx

from proctor.errors import ProctorError

__all__ = [
    "Conflict",
    "DataserverError",
    "NotReadyError",
    "RequestRejected",
    "ServerError",
    "ServerFailure",
    "TransportError",
    "Unauthorized",
    "error_for",
]


class DataserverError(ProctorError):
    """Base class: something went wrong talking to the dataserver."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.request = request


class TransportError(DataserverError):
    """No answer: connection refused or reset, or a timeout, on every attempt."""


class NotReadyError(DataserverError):
    """The server did not answer /healthz within the readiness wait."""


class ServerError(DataserverError):
    """The server answered with an error status; ``detail`` is its explanation."""

    def __init__(self, response: httpx.Response, detail: str) -> None:
        request = response.request
        super().__init__(f"{response.status_code} from {request.method} {request.url}: {detail}", request=request)
        self.response = response
        self.status_code = response.status_code
        self.detail = detail


class RequestRejected(ServerError):
    """A 4xx: the request itself is wrong (the detail names the field)."""


class Unauthorized(RequestRejected):
    """401: send the server's PROCTOR_API_KEY as the client's ``api_key``."""


class Conflict(RequestRejected):
    """409: the request contradicts the server's record, e.g. an iteration sampled with another batch size."""


class ServerFailure(ServerError):
    """A 5xx, or a 429 (the server is overloaded), that persisted through the retries."""


def error_for(response: httpx.Response) -> ServerError:
    """The exception for an error response, with the server's ``detail`` when it sent one."""
    try:
        body = response.json()
        detail = body.get("detail") if isinstance(body, dict) else None
    except ValueError:
        detail = None
    text = str(detail) if detail is not None else (response.text[:500] or response.reason_phrase)
    status = response.status_code
    if status == 401:
        return Unauthorized(response, text)
    if status == 409:
        return Conflict(response, text)
    if 400 <= status < 500 and status != 429:
        return RequestRejected(response, text)
    return ServerFailure(response, text)
