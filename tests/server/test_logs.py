"""Log lines: text by default, one JSON object per line on request; one access line per request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proctor.server.logs import JsonFormatter, configure_logging

pytestmark = pytest.mark.anyio


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("uvicorn.access").disabled = False


def record(msg: str, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("proctor.access", logging.INFO, __file__, 1, msg, None, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_lines_carry_the_request_fields() -> None:
    line = JsonFormatter().format(record("POST /sample 200 1.2ms", method="POST", status=200, iteration=3))
    doc = json.loads(line)
    assert doc["level"] == "info"
    assert doc["logger"] == "proctor.access"
    assert doc["message"] == "POST /sample 200 1.2ms"
    assert (doc["method"], doc["status"], doc["iteration"]) == ("POST", 200, 3)
    assert doc["ts"].endswith("Z")


def test_configure_picks_the_format(restore_logging: None) -> None:
    configure_logging("warning", "json")
    [handler] = logging.getLogger().handlers
    assert isinstance(handler.formatter, JsonFormatter)
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("uvicorn.access").disabled
    configure_logging("info", "text")
    [handler] = logging.getLogger().handlers
    assert not isinstance(handler.formatter, JsonFormatter)


async def test_a_dispatch_that_found_nothing_stays_out_of_the_info_log(
    open_client: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="proctor.access")
    async with open_client(grader_workers=0) as c:
        path = "/experience/consumers/grader/dispatch"
        assert (await c.post(path, json={"count": 4})).json()["lease"] is None
        batch = (await c.post("/sample", json={"iteration": 0, "batch_size": 1})).json()
        item = {"sample_id": batch["samples"][0]["sample_id"], "slot": 0, "completion": "7"}
        graded = asyncio.ensure_future(c.post("/grade", json={"iteration": 0, "items": [item]}))
        found = (await c.post(path, json={"count": 4, "wait_s": 30})).json()
        assert found["lease"] is not None
        graded.cancel()  # its completion was leased, and is not graded here: that is not what this test is about
        with contextlib.suppress(asyncio.CancelledError):
            await graded
    lines = [(" ".join(r.getMessage().split()[:3]), r.levelname) for r in caplog.records if r.name == "proctor.access"]
    assert lines[0] == (f"POST {path} 200", "DEBUG")  # an idle worker's ask, every few seconds
    assert (f"POST {path} 200", "INFO") in lines  # one that took rows


async def test_one_access_line_per_request(open_client: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="proctor.access")
    async with open_client() as c:
        await c.post("/sample", json={"iteration": 4, "batch_size": 2})
        await c.post("/sample", json={"iteration": -1, "batch_size": 2})
        await c.get("/healthz")
        await c.get("/metrics")
    lines = [r for r in caplog.records if r.name == "proctor.access"]
    assert [(" ".join(r.getMessage().split()[:3]), r.levelname) for r in lines] == [
        ("POST /sample 200", "INFO"),
        ("POST /sample 422", "INFO"),
        # Health checks and scrapes that succeed stay out of the INFO log: a probe every 10 s would bury it.
        ("GET /healthz 200", "DEBUG"),
        ("GET /metrics 200", "DEBUG"),
    ]
    assert lines[0].getMessage().endswith(" iteration=4")
    first = lines[0]
    assert (first.method, first.path, first.status, first.iteration) == ("POST", "/sample", 200, 4)  # type: ignore[attr-defined]
    assert first.latency_ms >= 0  # type: ignore[attr-defined]
