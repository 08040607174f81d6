"""Hostile input against a real server: every field of every route at its type's extremes, malformed and
mistyped bodies, oversized bodies, authentication before the body, and requests that once hung the
server or crashed a route. Each answer must be a 4xx whose detail names the field (or a correct 2xx), come
quickly, and leave the server healthy.

Oversized and too many headers and slow clients are in ``tests/server/test_connection.py``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import ServerProcess
from proctor.wire.dataserver import MAX_COUNT, MAX_ITERATION

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

SAMPLE_ID = "add_1d:d03351e4be:3"  # served by the shipped arithmetic curriculum
JSON = {"Content-Type": "application/json"}
# A liveness bound: a hostile request is refused in milliseconds; this only catches a server that stalls (the
# requests it guards against held the loop for seconds, or for ever).
FAST_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    args = ["curricula/arithmetic.yaml", "--database-url", str(tmp / "state.db"), "--grader-workers", "1"]
    with ServerProcess(args, log=tmp / "server.log", cwd=ROOT) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        yield client


def send(http: httpx.Client, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST raw bytes; assert the answer was quick and the server is still healthy."""
    started = time.perf_counter()
    response = http.post(path, content=content, headers=JSON if headers is None else headers)
    elapsed = time.perf_counter() - started
    assert elapsed < FAST_S, f"{path} took {elapsed:.2f}s"
    started = time.perf_counter()
    assert http.get("/healthz").status_code == 200
    assert time.perf_counter() - started < FAST_S
    return response


def detail(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/json", response.text
    text: str = response.json()["detail"]
    return text


# --- requests that once hung the server or answered 500 ---------------------------------------------

REPRODUCTIONS = [
    pytest.param(
        "/sample",
        {"iteration": 10**30, "batch_size": 4},
        422,
        "iteration: Input should be less than or equal to 9007199254740991; got 1000000000000000000000000000000",
        id="iteration-1e30",
    ),
    pytest.param(
        "/sample",
        {"iteration": 2**63, "batch_size": 4},
        422,
        "iteration: Input should be less than or equal to 9007199254740991; got 9223372036854775808",
        id="iteration-2^63",
    ),
    pytest.param(
        "/sample",
        {"batch_size": 2106.0, "iteration": 20922789888000.0},
        422,
        "iteration: Input should be a JSON integer; got 20922789888000.0; batch_size: Input should be a JSON integer; got 2106.0",
        id="floats",
    ),
    pytest.param(
        "/sample",
        {"iteration": "5", "batch_size": 4},
        422,
        'iteration: Input should be a JSON integer; got "5"',
        id="iteration-string",
    ),
    pytest.param(
        "/sample",
        {"iteration": True, "batch_size": 4},
        422,
        "iteration: Input should be a JSON integer; got true",
        id="iteration-true",
    ),
    pytest.param(
        "/grade",
        {"iteration": 2**63, "items": [{"sample_id": SAMPLE_ID, "completion": "7"}]},
        422,
        "iteration: Input should be less than or equal to 9007199254740991; got 9223372036854775808",
        id="grade-iteration-2^63",
    ),
    pytest.param(
        "/grade",
        {"items": [{"sample_id": SAMPLE_ID, "completion": "7", "completion_index": 2**63}]},
        422,
        "items[0].completion_index: Input should be less than or equal to 2147483647; got 9223372036854775808",
        id="completion-index-2^63",
    ),
    pytest.param(
        "/grade",
        {"items": [{"sample_id": "0", "completion": "7"}]},
        422,
        "items[0].sample_id: malformed sample_id '0': expected '<source>:<10 hex version>:<record>'",
        id="sample-id-0",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), REPRODUCTIONS)
def test_requests_that_once_failed_get_a_fast_4xx_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    response = send(http, path, json.dumps(body).encode())
    assert response.status_code == status
    assert detail(response).startswith(message)


def test_a_lone_surrogate_is_refused_not_a_500(http: httpx.Client) -> None:
    body = b'{"items": [{"sample_id": "add_1d:d03351e4be:3", "completion": "7\\ud800"}]}'
    response = send(http, "/grade", body)
    assert response.status_code == 400
    assert detail(response).startswith(
        "body: malformed JSON (unexpected end of hex escape at line 1 column 71; "
        "a lone UTF-16 surrogate (\\ud800 to \\udfff) is not valid text)"
    )


@pytest.mark.parametrize("iteration", [10**6, 10**12, MAX_ITERATION], ids=["1e6", "1e12", "max"])
def test_a_stray_iteration_is_refused_at_once(http: httpx.Client, iteration: int) -> None:
    response = send(http, "/sample", json.dumps({"iteration": iteration, "batch_size": 8}).encode())
    assert response.status_code == 422
    assert detail(response).startswith(f"iteration: {iteration} is more than 100000 iterations past the run's latest")


def test_any_iteration_in_range_is_answered_at_once(tmp_path: Path) -> None:
    # With the leap lifted, every iteration the schema allows may be new: none costs more than another.
    args = ["curricula/arithmetic.yaml", "--database-url", ":memory:", "--grader-workers", "1"]
    env = {"PROCTOR_MAX_ITERATION_LEAP": str(MAX_ITERATION)}
    with (
        ServerProcess(args, log=tmp_path / "server.log", cwd=ROOT, env=env) as server,
        httpx.Client(base_url=server.url, timeout=30.0) as client,
    ):
        for iteration in (10**5, 10**6, 10**12, MAX_ITERATION):
            response = send(client, "/sample", json.dumps({"iteration": iteration, "batch_size": 8}).encode())
            assert response.status_code == 200
            assert response.json()["iteration"] == iteration
            assert [s["slot"] for s in response.json()["samples"]] == list(range(8))


# --- every field at its type's extremes -----------------------------------------------------------------

EXTREMES: dict[str, Any] = {
    "huge": 10**30,
    "int64+1": 2**63,
    "negative": -1,
    "float": 1.5,
    "whole-float": 2.0,
    "bool": True,
    "string": "5",
    "null": None,
    "object": {"a": 1},
    "list": [1],
}


class Field:
    """A field of a request body: where it is, its type, whether it may be null, a valid body around it."""

    def __init__(
        self,
        route: str,
        path: tuple[str | int, ...],
        kind: str,
        base: Callable[[], dict[str, Any]],
        *,
        optional: bool = False,
        limit: int = MAX_COUNT,
    ) -> None:
        self.route, self.path, self.kind, self.base, self.optional, self.limit = (
            route,
            path,
            kind,
            base,
            optional,
            limit,
        )

    @property
    def name(self) -> str:
        out = ""
        for p in self.path:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
        return out

    def body(self, value: Any) -> dict[str, Any]:
        body = self.base()
        target: Any = body
        for p in self.path[:-1]:
            target = target[p]
        target[self.path[-1]] = value
        return body

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "int":
            return type(value) is int and 0 <= value <= self.limit
        if self.kind == "positive":
            return type(value) is int and 0 < value <= self.limit
        if self.kind == "text":
            return isinstance(value, str)
        return False  # sample_id: no extreme is a well-formed id; items: none is a list of items


_fresh = iter(range(1000, 10**6))


def sample_body() -> dict[str, Any]:
    return {"iteration": next(_fresh), "batch_size": 4}


def grade_body() -> dict[str, Any]:
    return {"iteration": 0, "items": [{"sample_id": SAMPLE_ID, "completion": "7", "completion_index": 0}]}


FIELDS = [
    Field("/sample", ("iteration",), "int", sample_body, limit=MAX_ITERATION),
    Field("/sample", ("batch_size",), "positive", sample_body, limit=4096),
    Field("/sample", ("rank",), "int", sample_body, optional=True),
    Field("/sample", ("world_size",), "positive", sample_body, optional=True),
    Field("/grade", ("iteration",), "int", grade_body, optional=True, limit=MAX_ITERATION),
    Field("/grade", ("items",), "list", grade_body),
    Field("/grade", ("items", 0, "sample_id"), "sample_id", grade_body),
    Field("/grade", ("items", 0, "completion"), "text", grade_body),
    Field("/grade", ("items", 0, "completion_tokens"), "int", grade_body, optional=True),
    Field("/grade", ("items", 0, "completion_index"), "int", grade_body, optional=True),
    Field("/grade", ("items", 0, "slot"), "int", grade_body, optional=True),
]
CASES = [pytest.param(f, v, id=f"{f.route[1:]}:{f.name}={k}") for f in FIELDS for k, v in EXTREMES.items()]


@pytest.mark.parametrize(("field", "value"), CASES)
def test_every_field_at_its_extremes(http: httpx.Client, field: Field, value: Any) -> None:
    body = field.body(value)
    if field.route == "/sample" and field.name in ("rank", "world_size") and value is not None:
        body = {**body, "rank": 0, "world_size": 1, field.name: value}  # the pair goes together
    response = send(http, field.route, json.dumps(body).encode())
    if field.accepts(value):
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 422, response.text
    assert detail(response).startswith(field.name), detail(response)


# The experience store's numbers are JSON numbers too: ``true``, ``"2"`` and ``2.5`` are not read as 1, 2, 2.
STORE_NUMBERS = [
    ("PUT", "/experience/tables/9000", {"slots": 2}, "slots"),
    ("PUT", "/experience/tables/9001", {"slots": 2, "group_size": 2}, "group_size"),
    ("PUT", "/experience/consumers/scorer", {"needs": ["completion"], "dispatch_size": 2}, "dispatch_size"),
    ("POST", "/experience/consumers/grader/dispatch", {"count": 2}, "count"),
    ("POST", "/experience/consumers/grader/dispatch", {"count": 2, "lease_s": 2}, "lease_s"),
    ("POST", "/experience/consumers/grader/dispatch", {"count": 2, "wait_s": 0}, "wait_s"),
]


@pytest.mark.parametrize("value", [True, "2", 2.5], ids=["bool", "string", "float"])
@pytest.mark.parametrize(("method", "path", "base", "name"), STORE_NUMBERS, ids=[n for *_, n in STORE_NUMBERS])
def test_the_stores_numbers_are_json_numbers(
    http: httpx.Client, method: str, path: str, base: dict[str, Any], name: str, value: Any
) -> None:
    if name in ("lease_s", "wait_s") and value == 2.5:
        return  # a float is a lease's length, or a wait's
    response = http.request(method, path, json={**base, name: value})
    assert response.status_code == 422, response.text
    kind = "a valid number" if name in ("lease_s", "wait_s") else "a JSON integer"
    assert detail(response) == f"{name}: Input should be {kind}; got {json.dumps(value)}"


# --- malformed bodies, wrong content types, oversized bodies --------------------------------------------

MALFORMED = [
    pytest.param(b"", 400, "body: malformed JSON", id="empty"),
    pytest.param(b"{", 400, "body: malformed JSON", id="truncated"),
    pytest.param(b"\xff\xfe{}", 400, "body: malformed JSON", id="not-utf8"),
    pytest.param(b'{"iteration": 1e400, "batch_size": 4}', 422, "iteration: Input should be a JSON integer", id="inf"),
    pytest.param(
        b'{"iteration": NaN, "batch_size": 4}', 422, "iteration: Input should be a JSON integer; got NaN", id="nan"
    ),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, 400, "body: malformed JSON", id="deeply-nested"),
    pytest.param(b"[]", 422, "body: Input should be an object", id="a-list"),
    pytest.param(b"null", 422, "body: Input should be an object", id="null"),
    pytest.param(b'"x"', 422, "body: Input should be an object", id="a-string"),
    pytest.param(
        b'{"iteration": 0, "batch_size": 4, "junk": [' + b"[1,2,3]," * 200_000 + b"[]]}",
        422,
        "body: unknown field 'junk'; the fields are iteration, batch_size, rank, world_size",
        id="junk-field",
    ),
]


@pytest.mark.parametrize(("value", "message"), [(-1, "greater than or equal to 0"), (31, "less than or equal to 30")])
def test_a_dispatch_waits_at_most_30_seconds(http: httpx.Client, value: int, message: str) -> None:
    response = http.post("/experience/consumers/grader/dispatch", json={"count": 2, "wait_s": value})
    assert response.status_code == 422, response.text
    assert detail(response) == f"wait_s: Input should be {message}; got {value}"


@pytest.mark.parametrize(
    ("then", "message"),
    [
        ({"wait_s": 31}, "next.wait_s: Input should be less than or equal to 30; got 31"),
        ({"count": 0}, "next.count: Input should be greater than or equal to 1; got 0"),
        ({"cuont": 2}, "next: unknown field 'cuont'; the fields are count, iteration, groups, dp_size"),
    ],
    ids=["wait_s", "count", "typo"],
)
def test_a_collections_next_dispatch_is_checked_as_a_dispatch(
    http: httpx.Client, then: dict[str, Any], message: str
) -> None:
    response = http.post("/experience/leases/0123456789abcdef/collect", json={"columns": {}, "next": then})
    assert response.status_code == 422, response.text
    assert detail(response).startswith(message), detail(response)


@pytest.mark.parametrize(("body", "status", "message"), MALFORMED)
def test_malformed_bodies(http: httpx.Client, body: bytes, status: int, message: str) -> None:
    response = send(http, "/sample", body)
    assert response.status_code == status, response.text
    if message:
        assert detail(response).startswith(message)


def test_a_million_wrong_items_are_refused_at_the_first(http: httpx.Client) -> None:
    body = b'{"items": [' + b",".join([b"[1,2,3,4,5,6,7,8,9,0]"] * 90_000) + b"]}"
    response = send(http, "/grade", body)
    assert response.status_code == 422
    assert detail(response) == "items[0]: Input should be an object; got [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]"


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
    ids=["none", "text", "form", "multipart", "lookalike"],
)
def test_a_body_not_declared_json_is_415(http: httpx.Client, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = send(http, "/sample", b'{"iteration": 0, "batch_size": 4}', headers)
    assert response.status_code == 415
    assert detail(response).startswith("Content-Type: ")
    assert detail(response).endswith("send it with the header 'Content-Type: application/json'")


def test_a_json_content_type_with_parameters_is_accepted(http: httpx.Client) -> None:
    response = send(
        http, "/sample", b'{"iteration": 1, "batch_size": 4}', {"Content-Type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200


def test_an_oversized_body_is_413_before_it_is_read(http: httpx.Client) -> None:
    body = b'{"items": [' + b" " * (5 * 1024 * 1024) + b"]}"
    response = send(http, "/grade", body)
    assert response.status_code == 413
    assert detail(response).startswith("body: ")
    assert "above this server's limit of 2097152 bytes (PROCTOR_MAX_BODY_BYTES)" in detail(response)


def test_an_oversized_chunked_body_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"items": ['
        for _ in range(80):
            yield b" " * 65536
        yield b"]}"

    started = time.perf_counter()
    response = http.post("/grade", content=chunks(), headers=JSON)
    assert time.perf_counter() - started < FAST_S
    assert response.status_code == 413
    assert "PROCTOR_MAX_BODY_BYTES" in detail(response)


def test_the_largest_grade_request_is_served(http: httpx.Client) -> None:
    items = [{"sample_id": SAMPLE_ID, "completion": str(k), "completion_index": k} for k in range(4096)]
    response = send(http, "/grade", json.dumps({"iteration": 0, "items": items}).encode())
    assert response.status_code == 200
    assert [r["completion_index"] for r in response.json()["results"]] == list(range(4096))
    over = send(http, "/grade", json.dumps({"iteration": 0, "items": [*items, items[0]]}).encode())
    assert over.status_code == 422
    assert detail(over).startswith(
        "items: 4097 items is above this server's maximum of 4096 per request (PROCTOR_MAX_GRADE_ITEMS)"
    )


# --- authentication comes before the body -------------------------------------------------------------


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("locked")
    args = ["curricula/arithmetic.yaml", "--database-url", ":memory:", "--grader-workers", "1"]
    with ServerProcess(args, log=tmp / "server.log", cwd=ROOT, env={"PROCTOR_API_KEY": "k3y"}) as proc:
        yield proc


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        pytest.param(JSON, b"{not json", id="malformed-json"),
        pytest.param({"Content-Type": "text/plain"}, b"x", id="wrong-content-type"),
        pytest.param({**JSON, "Authorization": "Bearer wrong"}, b"{not json", id="wrong-key"),
    ],
)
def test_without_the_key_nothing_is_read(locked: ServerProcess, headers: dict[str, str], body: bytes) -> None:
    with httpx.Client(base_url=locked.url, timeout=10.0) as http:
        response = http.post("/grade", content=body, headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert detail(response).startswith("Authorization: ")
        keyed = http.post("/grade", content=b"{not json", headers={**JSON, "Authorization": "Bearer k3y"})
        assert keyed.status_code == 400
        assert detail(keyed).startswith("body: malformed JSON")


def test_without_the_key_a_declared_body_is_not_waited_for(locked: ServerProcess) -> None:
    # 64 MiB announced, none sent: the 401 comes from the head alone.
    host, port = locked.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /grade HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 67108864\r\n\r\n"
        )
        answer = b""
        while b"}" not in answer:  # the head and the JSON body may come in two reads
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert b'{"detail":"Authorization: missing' in answer
