"""Pure ASGI middleware: the request-body limit, and per-request metrics with one access-log line.

Pure ASGI rather than ``BaseHTTPMiddleware``: it adds no task per request and an exception raised inside
it becomes the intended response, not a 500.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proctor.server.metrics import Metrics

__all__ = ["BodyLimitMiddleware", "RequestMetricsMiddleware"]

access_log = logging.getLogger("proctor.access")


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})


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
            access_log.info(
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
