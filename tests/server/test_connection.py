"""Hostile clients against a real server: oversized heads, slowloris, slow bodies, too many connections."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from proctor.cli.launcher import ServerProcess

pytestmark = pytest.mark.e2e

# A liveness bound, several times the 1 s deadlines under test: it fails on a hang, not on a busy machine.
ALIVE_S = 8.0

Start = Callable[..., ServerProcess]


def _start(server_process: Start, curriculum_file: Path, **env: object) -> ServerProcess:
    return server_process(
        [str(curriculum_file), "--database-url", ":memory:", "--grader-workers", "1"],
        env={f"PROCTOR_{name.upper()}": str(value) for name, value in env.items()},
    )


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def _recv(sock: socket.socket, deadline: float) -> bytes:
    """Up to 64 KiB; b"" once the server closed (or reset) the connection."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(65536)
    except TimeoutError:
        raise AssertionError("no answer from the server in time") from None
    except ConnectionResetError:
        return b""


def _read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body, read off a raw socket."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = _recv(sock, deadline)
        assert chunk, f"connection closed before a full response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = _recv(sock, deadline)
        assert chunk, f"connection closed in the middle of a response body: {body!r}"
        body += chunk
    assert len(body) == length, "more bytes than one response"
    return int(status_line.split()[1]), headers, body


def _closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes the connection within ``timeout`` (bytes it sends meanwhile are dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not _recv(sock, deadline):
                return True
        except AssertionError:
            return False
    return False


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: proctor\r\n\r\n".encode()


def _detail(body: bytes) -> str:
    detail: str = json.loads(body)["detail"]
    return detail


def _assert_refused(status: int, headers: dict[str, str], body: bytes, expected: int, *phrases: str) -> None:
    """A refusal at the connection: ``expected``, the connection closed, a JSON detail with every phrase."""
    assert status == expected
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    detail = _detail(body)
    for phrase in phrases:
        assert phrase in detail, detail


def _healthz_seconds(server: ServerProcess, client: httpx.Client | None = None) -> float:
    started = time.perf_counter()
    response = client.get("/healthz") if client else httpx.get(server.url + "/healthz", timeout=5)
    assert response.status_code == 200
    return time.perf_counter() - started


def test_an_oversized_header_gets_431_at_once(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file)

    # Just under the bound (16384 bytes of head by default) is served.
    with _connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: proctor\r\nX-Pad: " + b"a" * 15_000 + b"\r\n\r\n")
        assert _read_response(sock)[0] == 200

    started = time.monotonic()
    with _connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: proctor\r\nX-Big: ")
        try:
            for _ in range(16):  # 1 MiB of one header value, 64 KiB at a time
                sock.sendall(b"a" * 65536)
        except OSError:  # the server refused and closed while more was on its way
            pass
        status, headers, body = _read_response(sock)
        assert _closed(sock, 4.0)
    elapsed = time.monotonic() - started

    _assert_refused(status, headers, body, 431, "longer than 16384 bytes", "PROCTOR_MAX_HEADER_BYTES")
    assert elapsed < ALIVE_S, f"the refusal took {elapsed:.1f}s"
    assert _healthz_seconds(server) < ALIVE_S
    assert "HTTP 431, connection closed" in server.output()


def test_too_many_header_fields_get_431(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file, max_headers=20)

    def head(fields: int) -> bytes:  # Host plus fields - 1 others
        return b"GET /healthz HTTP/1.1\r\nHost: proctor\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(fields - 1))

    with _connect(server) as sock:
        sock.sendall(head(20) + b"\r\n")
        assert _read_response(sock)[0] == 200
    with _connect(server) as sock:
        sock.sendall(head(21) + b"\r\n")
        status, headers, body = _read_response(sock)
        assert _closed(sock, 4.0)
    _assert_refused(status, headers, body, 431, "more than 20 header fields", "PROCTOR_MAX_HEADERS")
    assert _healthz_seconds(server) < ALIVE_S


def test_slowloris_connections_are_closed_and_healthz_stays_fast(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file, header_timeout_s=1)
    partial = b"GET /healthz HTTP/1.1\r\nHost: proctor\r\nX-Slow: " + b"a" * 4096  # never finished
    prober = httpx.Client(base_url=server.url, timeout=5)
    _healthz_seconds(server, prober)  # connected before the timing starts
    opened_at = time.monotonic()
    conns = [_connect(server) for _ in range(50)]
    closed_after: dict[int, float] = {}  # written by the dripping thread only

    def drip() -> None:
        """One byte per connection every 50 ms, until the server closes each (or 8 s pass)."""
        for sock in conns:
            sock.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 8
        while len(closed_after) < len(conns) and time.monotonic() < deadline and sent < len(partial):
            for i, sock in enumerate(conns):
                if i in closed_after:
                    continue
                try:
                    sock.send(partial[sent : sent + 1])
                    if sock.recv(65536) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:  # closed: a reset, a broken pipe, or the end of a 408 already read
                    closed_after[i] = time.monotonic() - opened_at
            sent += 1
            time.sleep(0.05)

    dripper = threading.Thread(target=drip, name="slowloris")
    dripper.start()
    quiet: list[socket.socket] = []
    try:
        # Probes while the 50 are held: the server cannot close them before 1 s after they were opened.
        held_probes: list[float] = []
        for _ in range(20):
            seconds = _healthz_seconds(server, prober)
            if time.monotonic() - opened_at < 1.0:
                held_probes.append(seconds)
            if len(held_probes) >= 5:
                break
            time.sleep(0.02)
        # A connection that says nothing, and one that stops mid-head, get a 408 they can read.
        quiet_opened = time.monotonic()
        quiet += [_connect(server), _connect(server)]
        quiet[1].sendall(b"GET /healthz HTTP/1.1\r\nHost: proc")
        answers = [_read_response(sock) for sock in quiet]
        quiet_took = time.monotonic() - quiet_opened
        assert all(_closed(sock, 4.0) for sock in quiet)
    finally:
        dripper.join(timeout=15)
        prober.close()
        for sock in conns + quiet:
            sock.close()

    # A loop held by the slow connections would answer no probe before their 1 s deadline frees it.
    assert held_probes, "no /healthz probe was answered while the slow connections were held"
    assert len(closed_after) == len(conns), f"{len(conns) - len(closed_after)} slow connections still open"
    assert max(closed_after.values()) < ALIVE_S, sorted(closed_after.values())[-5:]
    assert 0.9 < quiet_took < ALIVE_S  # not before the 1 s deadline; the bound only catches a hang
    for status, headers, body in answers:
        _assert_refused(status, headers, body, 408, "headers not received within 1s", "PROCTOR_HEADER_TIMEOUT_S")
    assert _healthz_seconds(server) < ALIVE_S


def test_a_body_that_never_arrives_gets_408(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file, body_timeout_s=1)
    started = time.monotonic()
    with _connect(server) as sock:
        head = b"POST /grade HTTP/1.1\r\nHost: proctor\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head + b'{"items": [')
        status, headers, body = _read_response(sock)
        took = time.monotonic() - started
        assert _closed(sock, 4.0)
    _assert_refused(status, headers, body, 408, "body not received within 1s", "PROCTOR_BODY_TIMEOUT_S")
    assert 0.9 < took < ALIVE_S  # not before the 1 s deadline; the bound only catches a hang
    assert _healthz_seconds(server) < ALIVE_S
    assert "HTTP 408, connection closed: request body not received" in server.output()
    assert "Exception in ASGI application" not in server.output()  # the route saw a disconnect, not a crash


def test_keep_alive_requests_each_get_their_own_deadlines(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file, header_timeout_s=1, body_timeout_s=1)
    body = json.dumps({"iteration": 0, "batch_size": 2}).encode()
    post = b"POST /sample HTTP/1.1\r\nHost: proctor\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    statuses: list[int] = []
    with _connect(server) as sock:
        sock.sendall(_get("/healthz"))
        statuses.append(_read_response(sock)[0])
        # Head and body in pieces, each piece well within its deadline.
        sock.sendall(post[:20])
        time.sleep(0.3)
        sock.sendall(post[20:] % len(body) + body[:5])
        time.sleep(0.3)
        sock.sendall(body[5:])
        status, _, answer = _read_response(sock)
        statuses.append(status)
        assert len(json.loads(answer)["samples"]) == 2
        # Idle between requests for longer than the head deadline: keep-alive's (5 s) governs that time.
        time.sleep(1.5)
        sock.sendall(_get("/meta"))
        statuses.append(_read_response(sock)[0])
        sock.sendall(_get("/healthz"))
        statuses.append(_read_response(sock)[0])
    assert statuses == [200, 200, 200, 200]


def test_past_max_connections_requests_get_503_until_others_close(server_process: Start, curriculum_file: Path) -> None:
    server = _start(server_process, curriculum_file, max_connections=4)
    # uvicorn counts the asking connection itself: with a limit of 4, three can be open and served.
    kept: list[socket.socket] = []
    for _ in range(3):
        sock = _connect(server)
        kept.append(sock)
        sock.sendall(_get("/healthz"))
        assert _read_response(sock)[0] == 200  # and now idle, kept alive
    kept.append(_connect(server))  # and one that says nothing
    try:
        with _connect(server) as sock:
            sock.sendall(_get("/healthz"))
            status, headers, body = _read_response(sock)
            assert _closed(sock, 4.0)
        assert (status, body, headers["connection"]) == (503, b"Service Unavailable", "close")
    finally:
        for sock in kept:
            sock.close()

    statuses: list[int] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        statuses.append(httpx.get(server.url + "/healthz", timeout=5).status_code)
        if statuses[-1] == 200:
            break
        time.sleep(0.05)
    assert statuses[-1] == 200, statuses
    assert _healthz_seconds(server) < ALIVE_S
