"""Remote HTTP graders: a real grader service on loopback, and its failure paths through MockTransport."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proctor.server.grading.base import GradeInput
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.registry import RemoteGrader
from proctor.server.grading.remote import grade_remote

pytestmark = pytest.mark.anyio

ITEMS = [GradeInput(prompt="p", completion=c, answer="yes") for c in ("yes", "no", "yes")]


def grader(url: str = "http://grader.test/score", timeout_s: float = 5.0) -> RemoteGrader:
    return RemoteGrader("judge", url, timeout_s, {"X-Token": "t"}, {"strict": True}, 1.0, False)


async def score_with(handler: Callable[[httpx.Request], httpx.Response]) -> list[GraderOutcome]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await grade_remote(client, grader(), ITEMS)


async def test_request_shape_and_id_matching() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["token"] = request.headers["x-token"]
        # Answer in reverse order: matching must go by id.
        return httpx.Response(200, json={"scores": {"2": 0.25, "1": 0.0, "0": 1.0}})

    assert [o.score for o in await score_with(handler)] == [1.0, 0.0, 0.25]
    assert seen["token"] == "t"
    assert seen["body"]["params"] == {"strict": True}
    assert [i["id"] for i in seen["body"]["items"]] == ["0", "1", "2"]
    assert seen["body"]["items"][1] == {
        "id": "1",
        "prompt": "p",
        "answer": "yes",
        "metadata": {},
        "completion": "no",
        "completion_tokens": None,
    }


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(500, text="kaput"), "remote grader 'judge' answered HTTP 500: kaput"),
        (httpx.Response(200, text="not json"), "remote grader 'judge' sent no {'scores': {id: score}} object"),
        (httpx.Response(200, json={"scores": [1, 2, 3]}), "`scores` is not an object"),
    ],
    ids=["http-500", "not-json", "scores-list"],
)
async def test_a_bad_answer_is_an_error_for_every_item(response: httpx.Response, message: str) -> None:
    results = await score_with(lambda request: response)
    assert all(r.failure is FailureKind.REMOTE and message in r.message and r.score is None for r in results)


async def test_missing_or_invalid_scores_are_per_item_errors() -> None:
    results = await score_with(lambda r: httpx.Response(200, json={"scores": {"0": 1, "2": "high"}}))
    assert results[0] == GraderOutcome.scored(1.0)
    assert results[1] == GraderOutcome.failed(
        FailureKind.REMOTE, "remote grader 'judge' returned no finite score for item 1 (got None)"
    )
    assert results[2] == GraderOutcome.failed(
        FailureKind.REMOTE, "remote grader 'judge' returned no finite score for item 2 (got 'high')"
    )


async def test_timeouts_and_connection_errors() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("too slow", request=request)

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    timed_out = GraderOutcome.failed(FailureKind.TIMEOUT, "remote grader 'judge' timed out after 5s")
    assert await score_with(slow) == [timed_out] * 3
    unreachable = await score_with(down)
    assert all(r.failure is FailureKind.REMOTE for r in unreachable)
    assert all(r.message.startswith("remote grader 'judge' unreachable: ConnectError") for r in unreachable)


# --- against a real grader service -----------------------------------------------------------------------


async def _score(request: Request) -> JSONResponse:
    body = await request.json()
    scores = {i["id"]: 1.0 if i["completion"].strip() == i["answer"] else 0.0 for i in body["items"]}
    return JSONResponse({"scores": scores})


@pytest.fixture
def grader_service() -> Iterator[str]:
    config = uvicorn.Config(Starlette(routes=[Route("/score", _score, methods=["POST"])]), port=0, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/score"
    server.should_exit = True
    thread.join(timeout=5)


async def test_a_curriculum_with_a_remote_grader(
    grader_service: str, tmp_path: Path, open_client: Callable[..., Any]
) -> None:
    doc = {
        "name": "remote",
        "sources": {
            "add": {"kind": "arithmetic", "graders": [{"name": "judge", "weight": 3}, {"name": "numeric", "weight": 1}]}
        },
        "graders": {"judge": {"url": grader_service, "timeout_s": 5}},
        "stages": [{"name": "only", "until_step": 5, "mix": [{"source": "add"}]}],
    }
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(doc))
    async with open_client(curriculum=path) as c:
        samples = (await c.post("/sample", json={"iteration": 0, "batch_size": 2})).json()["samples"]
        items = []
        for s in samples:
            right = str(eval(s["metadata"]["expression"]))
            items += [
                {"sample_id": s["sample_id"], "completion": right, "completion_index": 0},
                {"sample_id": s["sample_id"], "completion": f"{right}.0", "completion_index": 1},
            ]
        results = (await c.post("/grade", json={"items": items})).json()["results"]
    # The judge wants the exact text (weight 3); numeric accepts "7.0" (weight 1): 1.0 and 0.25.
    assert [r["reward"] for r in results] == [1.0, 0.25, 1.0, 0.25]
    assert results[1]["components"] == {"judge": 0.0, "numeric": 1.0}


async def test_failures_say_whether_they_were_timeouts() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("too slow", request=request)

    timed_out = await score_with(slow)
    refused = await score_with(lambda r: httpx.Response(503, text="busy"))
    assert [r.failure for r in timed_out] == [FailureKind.TIMEOUT] * 3
    assert [r.failure for r in refused] == [FailureKind.REMOTE] * 3
