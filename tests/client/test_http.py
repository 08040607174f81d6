"""``ProctorClient`` against scripted ``httpx.MockTransport`` servers (routes, retries, backoff, errors,
pickling) and, where the server answers as it should, against a real one."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pydantic
import pytest

from proctor.client import ProctorClient
from proctor.client.errors import (
    Conflict,
    DataserverError,
    NotReadyError,
    RequestRejected,
    ServerError,
    ServerFailure,
    TransportError,
    Unauthorized,
)
from proctor.wire.dataserver import (
    CurriculumState,
    GradeItem,
    GradeResponse,
    Health,
    Meta,
    SampleResponse,
)

BASE = "http://proctor.test"

SAMPLE_ITEMS = [
    {
        "sample_id": "add:0123456789:0",
        "slot": 0,
        "dataset_id": "add",
        "prompt": "1 + 1 = ?",
        "metadata": {"answer": "2"},
    },
    {
        "sample_id": "add:0123456789:1",
        "slot": 1,
        "dataset_id": "add",
        "system_prompt": "Be brief.",
        "prompt": "2 + 2 = ?",
    },
]
SAMPLES = {"samples": SAMPLE_ITEMS, "stage": "warm", "stage_index": 0, "iteration": 3, "batch_size": 2}
SHARD = {**SAMPLES, "samples": SAMPLE_ITEMS[:1], "rank": 0, "world_size": 2}
GRADES = {
    "results": [
        {"sample_id": "add:0123456789:0", "completion_index": 0, "reward": 1.0, "components": {"numeric": 1.0}},
        {
            "sample_id": "add:0123456789:0",
            "completion_index": 1,
            "reward": -1.0,
            "error": "grader timed out",
            "cached": True,
        },
    ]
}
CURRICULUM = {
    "curriculum": "tiny",
    "curriculum_hash": "c0ffee",
    "current_stage": "warm",
    "current_stage_index": 0,
    "last_iteration": 3,
    "total_iterations": 30,
    "transitions": [],
    "stages": [
        {
            "name": "warm",
            "index": 0,
            "until_step": 10,
            "started_at": 0,
            "iterations": 4,
            "samples": 8,
            "graded": 16,
            "errors": 0,
            "mean_reward": 0.5,
            "rolling_reward": 0.5,
            "rolling_count": 16,
        }
    ],
}
HEALTH = {"status": "ok", "curriculum": "tiny", "last_iteration": None}

Step = Callable[[httpx.Request], httpx.Response]


def answer(
    status: int = 200, body: Any = HEALTH, *, content: bytes | None = None, headers: dict[str, str] | None = None
) -> Step:
    """A step that answers a fresh response: ``body`` as JSON, or raw ``content`` when given."""

    def step(request: httpx.Request) -> httpx.Response:
        if content is not None:
            return httpx.Response(status, content=content, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    return step


def fail(exc_type: type[httpx.TransportError]) -> Step:
    """A step that raises a transport error, as a refused or dropped connection would."""

    def step(request: httpx.Request) -> httpx.Response:
        raise exc_type(f"{exc_type.__name__} on purpose", request=request)

    return step


class Script:
    """A MockTransport handler that plays its steps in order (the last one forever) and records each request."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        return step(request)

    @property
    def attempts(self) -> int:
        return len(self.requests)


class FixedJitter:
    """Stands in for the client's ``random.Random``: the jitter factor is ``low + share·(high − low)``."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.bounds: set[tuple[float, float]] = set()

    def uniform(self, low: float, high: float) -> float:
        self.bounds.add((low, high))
        return low + self.share * (high - low)


@pytest.fixture
def delays() -> list[float]:
    return []


@pytest.fixture
def connect(
    delays: list[float], with_meta: Callable[[Script], httpx.MockTransport]
) -> Iterator[Callable[..., ProctorClient]]:
    """``connect(script, meta=False, **kwargs)``: a client whose transport is the script and whose sleeps are
    recorded. With ``meta``, ``GET /meta`` is answered off the script (the client reads the server's limits
    from it before its first ``/grade``), so the script sees only the requests under test."""
    clients: list[ProctorClient] = []

    def make(script: Script, *, meta: bool = False, **kwargs: Any) -> ProctorClient:
        kwargs.setdefault("backoff", 0.25)
        transport = with_meta(script) if meta else httpx.MockTransport(script)
        client = ProctorClient(BASE, transport=transport, sleep=delays.append, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


# --- routes, bodies and typed results ---------------------------------------------------------------------

ITEMS = [
    GradeItem(sample_id="add:0123456789:0", completion="2"),
    GradeItem(sample_id="add:0123456789:0", completion="3"),
]
INDEXED = [GradeItem(sample_id="add:0123456789:0", completion="2", completion_index=1, completion_tokens=7)]

ROUTES = [
    # (call, method, path, body sent (None: no body), answer, model)
    pytest.param(
        lambda c: c.sample(3, 2),
        "POST",
        "/sample",
        {"iteration": 3, "batch_size": 2},
        SAMPLES,
        SampleResponse,
        id="sample",
    ),
    pytest.param(
        lambda c: c.sample(3, 2, rank=0, world_size=2),
        "POST",
        "/sample",
        {"iteration": 3, "batch_size": 2, "rank": 0, "world_size": 2},
        SHARD,
        SampleResponse,
        id="sample-rank-0-of-2",
    ),
    pytest.param(
        lambda c: c.grade(ITEMS),
        "POST",
        "/grade",
        {
            "items": [
                {"sample_id": "add:0123456789:0", "completion": "2"},
                {"sample_id": "add:0123456789:0", "completion": "3"},
            ]
        },
        GRADES,
        GradeResponse,
        id="grade",
    ),
    pytest.param(
        lambda c: c.grade(iter(INDEXED), iteration=3),
        "POST",
        "/grade",
        {
            "iteration": 3,
            "items": [
                {"sample_id": "add:0123456789:0", "completion": "2", "completion_tokens": 7, "completion_index": 1}
            ],
        },
        GRADES,
        GradeResponse,
        id="grade-iteration-3",
    ),
    pytest.param(lambda c: c.curriculum(), "GET", "/curriculum", None, CURRICULUM, CurriculumState, id="curriculum"),
    pytest.param(lambda c: c.health(), "GET", "/healthz", None, HEALTH, Health, id="health"),
]


@pytest.mark.parametrize(("call", "method", "path", "sent", "payload", "model"), ROUTES)
def test_each_method_hits_its_route_and_returns_the_typed_model(
    connect: Callable[..., ProctorClient],
    call: Callable[[ProctorClient], Any],
    method: str,
    path: str,
    sent: dict[str, Any] | None,
    payload: dict[str, Any],
    model: type[pydantic.BaseModel],
) -> None:
    script = Script(answer(200, payload))
    result = call(connect(script, meta=path == "/grade"))

    assert type(result) is model
    assert result == model.model_validate(payload)
    [request] = script.requests
    assert request.method == method
    assert request.url == f"{BASE}{path}"
    if sent is None:
        assert request.content == b""
    else:
        assert request.headers["content-type"] == "application/json"
        assert json.loads(request.content) == sent


def test_meta_hits_its_route_and_returns_the_typed_model(
    connect: Callable[..., ProctorClient], meta: dict[str, Any]
) -> None:
    # Apart from ROUTES, whose table is built at import: its answer is the shared ``meta`` fixture.
    script = Script(answer(200, meta))
    result = connect(script).meta()

    assert type(result) is Meta
    assert result == Meta.model_validate(meta)
    [request] = script.requests
    assert request.method == "GET"
    assert request.url == f"{BASE}/meta"
    assert request.content == b""


def test_a_grade_beyond_the_servers_limits_is_sent_in_parts(
    live_server: Callable[..., AbstractContextManager[str]],
    recording: httpx.BaseTransport,
    sent: list[httpx.Request],
) -> None:
    # The server takes at most 100 items and 65,536 bytes per /grade (and refuses more).
    limits = {"max_grade_items": 100, "max_body_bytes": 65536}
    with live_server(**limits) as url, ProctorClient(url, transport=recording) as client:
        first, second = client.sample(4, 2).samples
        right = int(eval(first.metadata["expression"]))
        # Every third completion right, so each result's reward shows which completion it was matched to.
        many = [
            GradeItem(sample_id=first.sample_id, completion=str(right if k % 3 == 0 else right + 1), completion_index=k)
            for k in range(250)
        ]
        results = client.grade(many, iteration=4).results
        # 250 short items take 3 requests, in order.
        parts = [json.loads(r.content) for r in sent if r.url.path == "/grade"]
        assert [r.completion_index for r in results] == list(range(250))
        assert [r.reward for r in results] == [float(k % 3 == 0) for k in range(250)]
        assert [len(p["items"]) for p in parts] == [100, 100, 50]
        assert [i["completion_index"] for p in parts for i in p["items"]] == list(range(250))
        assert all(p["iteration"] == 4 for p in parts)
        # 20 completions of 10,000 characters: by bytes, 6 per request at most.
        already = len(sent)
        long = [GradeItem(sample_id=second.sample_id, completion="x" * 10_000, completion_index=k) for k in range(20)]
        assert [r.completion_index for r in client.grade(long).results] == list(range(20))
        sizes = [len(r.content) for r in sent[already:] if r.url.path == "/grade"]
        assert len(sizes) == 4 and max(sizes) <= 65_536
    assert [r.url.path for r in sent].count("/meta") == 1  # read once, on the first /grade


def test_sample_results_keep_their_fields(connect: Callable[..., ProctorClient]) -> None:
    batch = connect(Script(answer(200, SAMPLES))).sample(3, 2)

    assert [s.sample_id for s in batch.samples] == ["add:0123456789:0", "add:0123456789:1"]
    assert batch.samples[0].metadata == {"answer": "2"}
    assert batch.samples[1].system_prompt == "Be brief."
    assert (batch.iteration, batch.batch_size, batch.rank, batch.world_size) == (3, 2, None, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"rank": 1}, "rank and world_size go together", id="rank-without-world-size"),
        pytest.param({"world_size": 2}, "rank and world_size go together", id="world-size-without-rank"),
        pytest.param({"rank": 2, "world_size": 2}, "rank 2 must be below world_size 2", id="rank-too-high"),
    ],
)
def test_a_bad_sample_request_is_refused_before_sending(
    connect: Callable[..., ProctorClient], kwargs: dict[str, int], message: str
) -> None:
    script = Script(answer(200, SAMPLES))
    with pytest.raises(pydantic.ValidationError, match=message):
        connect(script).sample(0, 4, **kwargs)
    assert script.attempts == 0


@pytest.mark.parametrize(
    ("api_key", "expected"),
    [
        pytest.param("s3cret", "Bearer s3cret", id="key"),
        pytest.param(None, None, id="no-key"),
        pytest.param("", None, id="empty-key"),
    ],
)
def test_the_bearer_token_is_sent_only_with_an_api_key(
    connect: Callable[..., ProctorClient], meta: dict[str, Any], api_key: str | None, expected: str | None
) -> None:
    script = Script(answer(200, meta), answer(200, SAMPLES))
    client = connect(script, api_key=api_key)
    client.meta()
    client.sample(0, 2)

    assert [r.headers.get("authorization") for r in script.requests] == [expected, expected]


# --- retries ----------------------------------------------------------------------------------------------

TRANSPORT_ERRORS = [
    pytest.param(httpx.ConnectError, id="connect-error"),
    pytest.param(httpx.ConnectTimeout, id="connect-timeout"),
    pytest.param(httpx.ReadTimeout, id="read-timeout"),
    pytest.param(httpx.ReadError, id="read-error"),
    pytest.param(httpx.RemoteProtocolError, id="remote-protocol-error"),
]


@pytest.mark.parametrize("exc_type", TRANSPORT_ERRORS)
def test_transport_errors_are_retried_until_an_answer(
    connect: Callable[..., ProctorClient], delays: list[float], exc_type: type[httpx.TransportError]
) -> None:
    script = Script(fail(exc_type), fail(exc_type), answer(200, SAMPLES))
    batch = connect(script, retries=3).sample(3, 2)

    assert batch == SampleResponse.model_validate(SAMPLES)
    assert script.attempts == 3
    assert len(delays) == 2
    # Every attempt sends the same request.
    assert {(r.method, str(r.url), r.content) for r in script.requests} == {
        ("POST", f"{BASE}/sample", b'{"iteration":3,"batch_size":2}')
    }


@pytest.mark.parametrize("exc_type", TRANSPORT_ERRORS)
def test_transport_errors_past_the_retries_raise_transport_error(
    connect: Callable[..., ProctorClient], delays: list[float], exc_type: type[httpx.TransportError]
) -> None:
    script = Script(fail(exc_type))
    with pytest.raises(TransportError) as caught:
        connect(script, retries=2).meta()

    name = exc_type.__name__
    assert str(caught.value) == f"GET {BASE}/meta failed after 3 attempts: {name}: {name} on purpose"
    assert type(caught.value.__cause__) is exc_type
    assert caught.value.request is not None
    assert caught.value.request.url == f"{BASE}/meta"
    assert caught.value.request.method == "GET"
    assert isinstance(caught.value, DataserverError)
    assert not isinstance(caught.value, ServerError)
    assert script.attempts == 3
    assert len(delays) == 2


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429])
def test_retryable_statuses_are_retried_until_an_answer(
    connect: Callable[..., ProctorClient], delays: list[float], status: int
) -> None:
    script = Script(answer(status, {"detail": "busy"}), answer(status, {"detail": "busy"}), answer(200, GRADES))
    results = connect(script, meta=True, retries=2).grade(ITEMS, iteration=0)

    assert results == GradeResponse.model_validate(GRADES)
    assert script.attempts == 3
    assert len(delays) == 2


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_5xx_past_the_retries_raises_server_failure(
    connect: Callable[..., ProctorClient], delays: list[float], status: int
) -> None:
    script = Script(answer(status, {"detail": "the store is locked"}))
    with pytest.raises(ServerFailure) as caught:
        connect(script, retries=3).sample(1, 4)

    error = caught.value
    assert str(error) == f"{status} from POST {BASE}/sample: the store is locked"
    assert error.status_code == status
    assert error.detail == "the store is locked"
    assert error.response.status_code == status
    assert error.request is not None
    assert error.request.url == f"{BASE}/sample"
    assert isinstance(error, ServerError)
    assert not isinstance(error, RequestRejected)
    assert script.attempts == 4
    assert len(delays) == 3


def test_a_429_past_the_retries_is_a_server_error_with_its_status(
    connect: Callable[..., ProctorClient], delays: list[float]
) -> None:
    script = Script(answer(429, {"detail": "slow down"}))
    with pytest.raises(ServerError, match=r"^429 from GET http://proctor.test/meta: slow down$") as caught:
        connect(script, retries=2).meta()

    assert caught.value.status_code == 429
    assert caught.value.detail == "slow down"
    assert script.attempts == 3
    assert len(delays) == 2


LONG = "x" * 600


@pytest.mark.parametrize(
    ("step", "detail"),
    [
        pytest.param(answer(500, {"detail": "grader pool crashed"}), "grader pool crashed", id="json-detail"),
        pytest.param(answer(500, {"detail": ["a", "b"]}), "['a', 'b']", id="json-list-detail"),
        pytest.param(answer(502, content=b"<html>Bad Gateway</html>"), "<html>Bad Gateway</html>", id="html-body"),
        pytest.param(answer(503, content=b'{"error": "x"}'), '{"error": "x"}', id="json-without-detail"),
        pytest.param(answer(500, content=b"[1, 2]"), "[1, 2]", id="json-list-body"),
        pytest.param(answer(504, content=b""), "Gateway Timeout", id="empty-body-reason-phrase"),
        pytest.param(answer(500, content=LONG.encode()), LONG[:500], id="long-body-truncated"),
    ],
)
def test_the_detail_falls_back_to_the_body_then_the_reason_phrase(
    connect: Callable[..., ProctorClient], step: Step, detail: str
) -> None:
    script = Script(step)
    with pytest.raises(ServerFailure) as caught:
        connect(script, retries=0).health()

    assert caught.value.detail == detail
    assert str(caught.value).endswith(f"from GET {BASE}/healthz: {detail}")
    assert script.attempts == 1


REJECTIONS = [
    # (status, detail, exception type)
    pytest.param(400, "batch_size 500 is above the server's max_batch_size 64", RequestRejected, id="400"),
    pytest.param(404, "Not Found", RequestRejected, id="404"),
    pytest.param(
        422, [{"loc": ["body", "batch_size"], "msg": "Input should be greater than 0"}], RequestRejected, id="422"
    ),
    pytest.param(401, "missing or wrong API key", Unauthorized, id="401"),
    pytest.param(409, "iteration 3 was sampled with batch_size 8, not 4", Conflict, id="409"),
]


@pytest.mark.parametrize(("status", "detail", "exc_type"), REJECTIONS)
def test_other_4xx_are_raised_at_once(
    connect: Callable[..., ProctorClient],
    delays: list[float],
    status: int,
    detail: Any,
    exc_type: type[RequestRejected],
) -> None:
    script = Script(answer(status, {"detail": detail}), answer(200, SAMPLES))
    with pytest.raises(exc_type) as caught:
        connect(script, retries=5).sample(3, 4)

    error = caught.value
    assert type(error) is exc_type
    assert isinstance(error, RequestRejected)
    assert isinstance(error, ServerError)
    assert isinstance(error, DataserverError)
    assert not isinstance(error, ServerFailure)
    assert error.status_code == status
    assert error.detail == str(detail)
    assert str(error) == f"{status} from POST {BASE}/sample: {detail}"
    assert error.response.json() == {"detail": detail}
    assert script.attempts == 1
    assert delays == []


def test_the_exception_tree() -> None:
    cls: type[DataserverError]
    for cls in (Unauthorized, Conflict):
        assert issubclass(cls, RequestRejected)
    for cls in (RequestRejected, ServerFailure):
        assert issubclass(cls, ServerError)
    for cls in (TransportError, NotReadyError, ServerError):
        assert issubclass(cls, DataserverError)
    assert not issubclass(ServerFailure, RequestRejected)


# --- backoff ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "share", [pytest.param(0.0, id="low"), pytest.param(0.5, id="mid"), pytest.param(1.0, id="high")]
)
@pytest.mark.parametrize(
    "failure", [pytest.param(answer(503), id="503"), pytest.param(fail(httpx.ConnectError), id="connect")]
)
def test_backoff_doubles_with_jitter_up_to_max_backoff(
    connect: Callable[..., ProctorClient], delays: list[float], share: float, failure: Step
) -> None:
    client = connect(Script(failure), retries=6, backoff=0.5, max_backoff=4.0)
    jitter = FixedJitter(share)
    client._rng = jitter  # type: ignore[assignment]
    with pytest.raises(DataserverError):
        client.health()

    factor = 0.5 + share
    # Jitter first, then the cap: no delay is ever longer than max_backoff.
    assert delays == pytest.approx([min(4.0, b * factor) for b in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)])
    assert jitter.bounds == {(0.5, 1.5)}


def test_real_jitter_stays_within_half_and_one_and_a_half_times_the_schedule(
    connect: Callable[..., ProctorClient], delays: list[float]
) -> None:
    with pytest.raises(ServerFailure):
        connect(Script(answer(500)), retries=40, backoff=0.001, max_backoff=0.016).health()

    schedule = [0.001 * 2**attempt for attempt in range(40)]
    for delay, base in zip(delays, schedule, strict=True):
        assert min(0.016, 0.5 * base) <= delay <= min(0.016, 1.5 * base)
    assert len(set(delays[:3])) == 3  # it is jitter, not a constant factor


def test_no_delay_exceeds_max_backoff(connect: Callable[..., ProctorClient], delays: list[float]) -> None:
    client = connect(Script(answer(503)), retries=6, backoff=0.5, max_backoff=4.0)
    client._rng = FixedJitter(1.0)  # type: ignore[assignment]
    with pytest.raises(ServerFailure):
        client.health()

    assert max(delays) <= 4.0, delays


@pytest.mark.parametrize(
    ("status", "retry_after", "expected"),
    [
        pytest.param(429, "2", 2.0, id="seconds"),
        pytest.param(429, "0.5", 0.5, id="fractional"),
        pytest.param(429, "0", 0.0, id="zero"),
        pytest.param(429, "-3", 0.0, id="negative-clamped"),
        pytest.param(429, "30", 8.0, id="capped-by-max-backoff"),
        pytest.param(503, "3", 3.0, id="on-a-503"),
        # An HTTP date is not parsed: the client's own schedule applies (0.25 s × jitter, here fixed at 1×).
        pytest.param(429, "Wed, 21 Oct 2015 07:28:00 GMT", 0.25, id="http-date-falls-back"),
        pytest.param(429, "soon", 0.25, id="garbage-falls-back"),
    ],
)
def test_retry_after_is_honoured_and_capped(
    connect: Callable[..., ProctorClient],
    delays: list[float],
    meta: dict[str, Any],
    status: int,
    retry_after: str,
    expected: float,
) -> None:
    script = Script(answer(status, {"detail": "later"}, headers={"Retry-After": retry_after}), answer(200, meta))
    client = connect(script, retries=1, backoff=0.25, max_backoff=8.0)
    client._rng = FixedJitter(0.5)  # type: ignore[assignment]

    assert client.meta() == Meta.model_validate(meta)
    assert delays == [expected]
    assert script.attempts == 2


def test_no_retries_means_one_attempt(connect: Callable[..., ProctorClient], delays: list[float]) -> None:
    refused = Script(fail(httpx.ConnectError))
    with pytest.raises(TransportError, match=r"^GET http://proctor.test/meta failed after 1 attempt"):
        connect(refused, retries=0).meta()
    failing = Script(answer(503, {"detail": "down"}))
    with pytest.raises(ServerFailure, match=r"^503 from GET http://proctor.test/meta: down$"):
        connect(failing, retries=0).meta()

    assert (refused.attempts, failing.attempts) == (1, 1)
    assert delays == []


def test_negative_retries_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^retries must be ≥ 0, got -1$"):
        ProctorClient(BASE, retries=-1, transport=httpx.MockTransport(Script(answer())))


# --- wait_ready -------------------------------------------------------------------------------------------


def test_wait_ready_polls_until_healthz_answers(connect: Callable[..., ProctorClient], delays: list[float]) -> None:
    script = Script(
        fail(httpx.ConnectError),
        answer(503, {"detail": "loading the curriculum"}),
        fail(httpx.ReadTimeout),
        answer(200, {**HEALTH, "last_iteration": 7}),
    )
    health = connect(script, retries=0).wait_ready(timeout=60, interval=0.01)

    assert health == Health(status="ok", curriculum="tiny", last_iteration=7)
    assert [(r.method, str(r.url)) for r in script.requests] == [("GET", f"{BASE}/healthz")] * 4
    assert delays == [0.01, 0.01, 0.01]


def test_wait_ready_returns_at_once_when_ready(connect: Callable[..., ProctorClient], delays: list[float]) -> None:
    script = Script(answer(200, HEALTH))

    assert connect(script).wait_ready(timeout=1) == Health.model_validate(HEALTH)
    assert script.attempts == 1
    assert delays == []


@pytest.mark.parametrize(
    ("step", "last"),
    [
        pytest.param(fail(httpx.ConnectError), "ConnectError on purpose", id="refused"),
        pytest.param(answer(503, {"detail": "warming up"}), f"503 from GET {BASE}/healthz: warming up", id="503"),
    ],
)
def test_wait_ready_gives_up_after_its_timeout(
    connect: Callable[..., ProctorClient], delays: list[float], step: Step, last: str
) -> None:
    script = Script(step)
    # An interval longer than the timeout: the first failure already leaves no time for another poll.
    with pytest.raises(NotReadyError) as caught:
        connect(script).wait_ready(timeout=0.01, interval=1.0)

    assert str(caught.value) == (
        f"the dataserver at {BASE} was not ready after 0.01s (last: {last}); is `proctor serve` running there?"
    )
    assert isinstance(caught.value, DataserverError)
    assert script.attempts == 1
    assert delays == []


def test_wait_ready_keeps_polling_until_the_deadline(
    connect: Callable[..., ProctorClient], delays: list[float]
) -> None:
    script = Script(fail(httpx.ConnectError))
    # The injected sleep returns at once, so the polls spin until the real clock passes the deadline.
    with pytest.raises(NotReadyError, match=r"^the dataserver at http://proctor\.test was not ready after 0\.05s"):
        connect(script).wait_ready(timeout=0.05, interval=0.001)

    assert script.attempts >= 2
    assert delays == [0.001] * (script.attempts - 1)


# --- pickling and lifetime --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api_key", "authorization"),
    [pytest.param("tok", "Bearer tok", id="with-key"), pytest.param(None, None, id="without-key")],
)
def test_a_pickled_client_reconnects_with_the_same_settings(api_key: str | None, authorization: str | None) -> None:
    client = ProctorClient(
        "http://127.0.0.1:8000/", api_key=api_key, timeout=7.0, retries=3, backoff=0.5, max_backoff=2.0
    )
    copy = pickle.loads(pickle.dumps(client))
    try:
        assert type(copy) is ProctorClient
        assert copy is not client
        assert copy.base_url == client.base_url == "http://127.0.0.1:8000"
        assert (copy.retries, copy.backoff, copy.max_backoff) == (3, 0.5, 2.0)
        assert copy._http is not client._http
        assert copy._http.headers.get("authorization") == authorization
        assert copy._http.timeout == httpx.Timeout(7.0)
        assert copy._http.base_url == client._http.base_url
    finally:
        client.close()
        copy.close()


def test_a_pickled_client_survives_its_original_being_closed() -> None:
    client = ProctorClient("http://127.0.0.1:8000", api_key="tok")
    client.close()
    copy = pickle.loads(pickle.dumps(client))
    try:
        assert not copy._http.is_closed
    finally:
        copy.close()


def test_the_context_manager_closes_the_client(connect: Callable[..., ProctorClient]) -> None:
    client = connect(Script(answer(200, HEALTH)))
    with client as entered:
        assert entered is client
        assert entered.health() == Health.model_validate(HEALTH)

    with pytest.raises(RuntimeError, match="client has been closed"):
        client.health()


def test_the_context_manager_closes_the_client_on_an_error(connect: Callable[..., ProctorClient]) -> None:
    client = connect(Script(answer(200, HEALTH)))
    with pytest.raises(KeyError, match="boom"), client:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="client has been closed"):
        client.health()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        pytest.param(b"<html>proxy</html>", "Expecting value", id="not-json"),
        pytest.param(b'{"status": "ok"}', "2 validation errors for Health", id="wrong-shape"),
    ],
)
def test_an_answer_that_is_not_the_model_is_a_dataserver_error(
    connect: Callable[..., ProctorClient], body: bytes, problem: str
) -> None:
    client = connect(Script(lambda request: httpx.Response(200, content=body)))
    with pytest.raises(DataserverError, match=rf"(?s)GET {BASE}/healthz answered 200 but not with a Health: {problem}"):
        client.health()


def test_a_collection_answered_without_its_next_dispatch_is_an_experience_error(
    connect: Callable[..., ProctorClient],
) -> None:
    from proctor.client import ExperienceClient
    from proctor.experience import ExperienceError

    script = Script(answer(body={"consumer": "grader", "iteration": 0, "rows": [[0, 0]]}))
    with ExperienceClient(client=connect(script)) as experience, pytest.raises(ExperienceError) as caught:
        experience.collect_and_dispatch("0123456789abcdef", {"reward": [1.0]}, 4)
    assert str(caught.value) == "the server answered the collection without the dispatch it was asked for"
    sent = json.loads(script.requests[0].content)
    assert script.requests[0].url.path == "/experience/leases/0123456789abcdef/collect"
    assert sent["next"]["count"] == 4
