"""Pure ASGI middleware, each looking only at a request's head: the API key, the body's content type, the
body-size limit, per-request metrics with one access-log line, and a standby's forwarding of every request to
the server that serves its database.

The key and the content type are checked here rather than in route dependencies because FastAPI reads and
parses a route's body before it runs the route's dependencies: an unauthenticated client would reach the
JSON parser, and a wrong content type would surface as a confusing validation error.

Pure ASGI rather than ``BaseHTTPMiddleware``: it adds no task per request and an exception raised inside
it becomes the intended response, not a 500.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import httpx
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proctor.server.metrics import Metrics
from proctor.server.services.standby_grading import ServedElsewhere

if TYPE_CHECKING:
    from proctor.server.handle import DataserverHandle

__all__ = [
    "ApiKeyMiddleware",
    "BodyLimitMiddleware",
    "ForwardingMiddleware",
    "JsonBodyMiddleware",
    "RequestMetricsMiddleware",
]

access_log = logging.getLogger("proctor.access")
_PROBES = frozenset({"/healthz", "/metrics"})


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class ApiKeyMiddleware:
    """With an API key, every path but the open ones needs ``Authorization: Bearer <key>`` (401 otherwise),
    checked before anything reads the body."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None:
            detail = "Authorization: missing; this server requires the header 'Authorization: Bearer <PROCTOR_API_KEY>'"
        elif not secrets.compare_digest(given, self._expected):
            detail = "Authorization: the bearer token does not match this server's PROCTOR_API_KEY"
        else:
            await self.app(scope, receive, send)
            return
        await _send_json(send, 401, {"detail": detail}, [(b"www-authenticate", b"Bearer")])


class JsonBodyMiddleware:
    """A request with a body must declare it JSON (415 otherwise), before the body is read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-type")
        media = (declared or b"").split(b";", 1)[0].strip().lower()
        if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
            await self.app(scope, receive, send)
            return
        shown = "none" if declared is None else repr(declared[:80].decode("latin-1"))
        await _send_json(
            send,
            415,
            {
                "detail": f"Content-Type: {shown}; this route takes a JSON body: send it with the header "
                "'Content-Type: application/json'"
            },
        )


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with a 413, before they are buffered, whether or not they declare a
    Content-Length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _detail(self, size: str) -> dict[str, Any]:
        return {
            "detail": f"body: {size} is above this server's limit of {self.max_bytes} bytes "
            "(PROCTOR_MAX_BODY_BYTES); send fewer items per request"
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "Content-Length: not an integer"})
                    return
                if declared > self.max_bytes:
                    await _send_json(send, 413, self._detail(f"{declared} bytes"))
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # An HTTPException, because FastAPI turns any other error raised while it reads the body
                    # into a 400 "error parsing the body".
                    raise HTTPException(413, self._detail(f"more than {self.max_bytes} bytes")["detail"])
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as exc:
            # Reached only when the body was read outside a route (no exception handler ran).
            if exc.status_code != 413 or started:
                raise
            await _send_json(send, 413, {"detail": exc.detail})


class RequestMetricsMiddleware:
    """Counts and times every request by route template, and logs one line per request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            # The route template, never the raw path: raw paths would make label cardinality unbounded.
            label = getattr(route, "path", "unmatched")
            method = scope["method"]
            self.metrics.requests.labels(method, label, str(status)).inc()
            self.metrics.latency.labels(method, label).observe(elapsed)
            iteration = scope.get("state", {}).get("iteration")
            latency_ms = round(elapsed * 1000, 2)
            # A health check or a scrape every few seconds would bury the requests that matter: a probe that
            # succeeds is logged at DEBUG (its count and latency are in the metrics either way), as is a request
            # its route marked quiet (a dispatch that found nothing).
            probe = (label in _PROBES or scope.get("state", {}).get("quiet", False)) and status < 400
            access_log.log(
                logging.DEBUG if probe else logging.INFO,
                "%s %s %d %.1fms%s",
                method,
                scope["path"],
                status,
                latency_ms,
                "" if iteration is None else f" iteration={iteration}",
                extra={
                    "method": method,
                    "path": scope["path"],
                    "status": status,
                    "latency_ms": latency_ms,
                    "iteration": iteration,
                },
            )


_FORWARDED = b"x-proctor-forwarded"
_LOCAL = frozenset({"/metrics"})  # a standby's own answer: its metrics say it stands by
# Headers that describe one connection, not the request: the forwarded request and answer get their own.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"host",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)


class ForwardingMiddleware:
    """On a standby (:mod:`proctor.server.handle`), every request but ``/metrics`` goes to the server that serves
    the database, as it came (method, path, query, headers with the API key, body), and its answer comes back
    as it went. While the standby grades (:mod:`proctor.server.services.standby_grading`), a ``/grade`` goes to
    its own route first, and on to the serving server only when the route cannot place it.

    A request that a standby forwarded and that reaches another standby is not forwarded again: it gets a 503,
    as does one whose serving server does not answer (it ended; a standby takes over within seconds). Clients
    retry both. The inner middleware has bounded the body already."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle: DataserverHandle | None = scope.get("state", {}).get("dataserver") if scope["type"] == "http" else None
        target = None if handle is None else handle.forward_target()
        if handle is None or target is None or scope["path"] in _LOCAL:
            await self.app(scope, receive, send)
            return
        grading = scope["path"] == "/grade" and handle.standby_grading() is not None
        if not grading and _header(scope, _FORWARDED) is not None:
            await _unavailable(send, "this server stands by and so does the one that forwarded the request; retry")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if grading:
            try:
                await self.app(scope, _replayed(bytes(body), receive), send)
                return
            except ServedElsewhere:  # raised before the route answers anything
                target = handle.forward_target()
                if target is None or _header(scope, _FORWARDED) is not None:
                    await _unavailable(send, "this server stands by and cannot place this /grade now; retry")
                    return
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = target.rstrip("/") + path.decode("latin-1") + (("?" + query.decode("latin-1")) if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP] + [(_FORWARDED, b"1")]
        client = handle.forwarder
        try:
            answer = await client.send(
                client.build_request(scope["method"], url, headers=headers, content=bytes(body)), stream=True
            )
        except httpx.TransportError as exc:
            handle.serving_unreachable()
            await _unavailable(
                send,
                f"this server stands by, and the serving one at {target} does not answer ({type(exc).__name__}); "
                "a standby takes over within seconds: retry",
            )
            return
        try:
            out = [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await answer.aclose()


def _replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body, read already, handed out again first."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _unavailable(send: Send, detail: str) -> None:
    await _send_json(send, 503, {"detail": detail}, [(b"retry-after", b"1")])
