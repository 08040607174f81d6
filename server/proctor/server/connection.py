"""uvicorn's httptools protocol, hardened against clients that send huge heads or hold connections open.

A request head is bounded in bytes and header fields (431), and must arrive within a deadline, then its
body within another (408); both deadlines restart with each request of a keep-alive connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

if TYPE_CHECKING:
    from proctor.server.settings import Settings

__all__ = ["ConnectionLimits", "GuardedHttpToolsProtocol", "uvicorn_options"]


@dataclass(frozen=True)
class ConnectionLimits:
    """The connection settings (their defaults live in :class:`~proctor.server.settings.Settings`)."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float


class _CoalescedWrites:
    """A connection's transport whose writes within one turn of the event loop leave as one.

    A response is written as its head, then its body: two sends, and on loopback two wake-ups of the
    client. Sent together they cost one, which under load was a tenth of a /sample's time on the server.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Refused(Exception):
    """Raised in a parser callback: the only way to stop httptools in the middle of a buffer."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. ``limits`` is set on a subclass per server (see :func:`uvicorn_options`), because
    uvicorn builds protocols from a class and its own config only."""

    limits: ClassVar[ConnectionLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._head_bytes = 0
        self._header_count = 0
        self._heads_done = 0
        self._head_open = False  # a request has begun and its headers are not complete
        self._in_body = False  # headers complete, body not yet
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's narrowing
        coalesced: Any = _CoalescedWrites(transport, self.loop)
        super().connection_made(coalesced)
        # A client that connects and sends nothing must not hold the connection either.
        self._head_timer = self._arm(self.limits.header_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        self._unset_keepalive_if_required()
        if not self._in_body and self._head_timer is None:
            self._head_timer = self._arm(self.limits.header_timeout_s, self._head_expired)
        view = memoryview(data)
        while view:
            in_head, heads_done = not self._in_body, self._heads_done
            # httptools buffers an unfinished header field whole (by repeated bytes concatenation, which is
            # what made a 64 MiB header stall the server): never hand it more of a head than the bound.
            n = max(1, min(len(view), self.limits.max_header_bytes - self._head_bytes)) if in_head else len(view)
            try:
                self.parser.feed_data(view[:n])
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                if self._refusal is not None:
                    self._refuse_head(*self._refusal)
                else:
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("Invalid HTTP request received.")
                return
            view = view[n:]
            if in_head and not self._in_body and self._heads_done == heads_done:
                self._head_bytes += n
                if self._head_bytes >= self.limits.max_header_bytes:  # incomplete at the bound: over it
                    self._refuse_head(*self._too_large())
                    return

    # Parser callbacks, called from inside feed_data.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._header_count = 0
        self._head_open = True
        if self._head_timer is None:
            self._head_timer = self._arm(self.limits.header_timeout_s, self._head_expired)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (
                431,
                f"more than {self.limits.max_headers} header fields; the server's limit is set by PROCTOR_MAX_HEADERS",
            )
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._heads_done += 1
        self._cancel_timers()
        # The byte count in data_received misses a pipelined head that began mid-buffer; this catches it.
        # "METHOD URL HTTP/1.1\r\n", "name: value\r\n" each, "\r\n".
        size = len(self.parser.get_method()) + len(self.url) + 14 + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refusal = self._too_large()
            raise _Refused
        self._head_bytes = 0
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:  # not a websocket upgrade
            self._in_body = True
            self._body_timer = self._arm(self.limits.body_timeout_s, self._body_expired)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # Deadlines.

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.flow.read_paused:  # the server is not reading, so the client cannot be late
            self._head_timer = self._arm(self.limits.header_timeout_s, self._head_expired)
            return
        if not self._head_open and self._response_owed():
            # Stray bytes (a CRLF after a body) while the app works on the last request: not a head.
            return
        detail = (
            f"request headers not received within {self.limits.header_timeout_s:g}s; "
            "the server's limit is set by PROCTOR_HEADER_TIMEOUT_S"
        )
        self._refuse_head(408, detail)

    def _body_expired(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # Not the client's fault: the app has not read (or asked for) what was sent yet.
            self._body_timer = self._arm(self.limits.body_timeout_s, self._body_expired)
            return
        answer = not cycle.response_started and not self.pipeline
        if not cycle.response_complete:
            # The app may be waiting in receive(): wake it with a disconnect, and drop whatever it sends
            # later, as uvicorn does when the client goes away.
            cycle.disconnected = True
            cycle.message_event.set()
        detail = (
            f"request body not received within {self.limits.body_timeout_s:g}s; "
            "the server's limit is set by PROCTOR_BODY_TIMEOUT_S"
        )
        self._refuse(408, detail, answer=answer)

    # Helpers.

    def _too_large(self) -> tuple[int, str]:
        return (
            431,
            f"request line and headers longer than {self.limits.max_header_bytes} bytes; "
            "the server's limit is set by PROCTOR_MAX_HEADER_BYTES",
        )

    def _response_owed(self) -> bool:
        """Whether an earlier request on this connection still waits for (the end of) its response."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(delay, callback)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _refuse_head(self, status: int, detail: str) -> None:
        if not self._response_owed():
            self._refuse(status, detail, answer=True)
            return
        # A refusal written now would be read as the answer to an earlier request: let the app answer
        # those (uvicorn closes after a response that is not keep-alive), and read nothing more meanwhile.
        self._refusal = (status, detail)
        self._cancel_timers()
        self._log(status, detail)
        self.cycle.keep_alive = False
        self.flow.pause_reading()

    def _log(self, status: int, detail: str) -> None:
        prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
        # A 431 may be a client the operator should make room for; a 408 is routine under slow networks.
        level = logging.WARNING if status == 431 else logging.INFO
        self.logger.log(level, "%sHTTP %d, connection closed: %s", prefix, status, detail)

    def _refuse(self, status: int, detail: str, *, answer: bool) -> None:
        self._refusal = (status, detail)
        self._cancel_timers()
        self._log(status, detail)
        if self.transport.is_closing():
            return
        if answer:
            body = json.dumps({"detail": detail}).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that apply the connection settings."""
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )

    class Protocol(GuardedHttpToolsProtocol):
        pass

    Protocol.limits = limits
    # limit_concurrency counts open connections, idle ones included, and answers 503 past it.
    return {"http": Protocol, "limit_concurrency": settings.max_connections}
