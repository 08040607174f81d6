"""/healthz, /metrics and the optional bearer token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.anyio

PROTECTED: list[tuple[str, str, dict[str, object] | None]] = [
    ("GET", "/meta", None),
    ("GET", "/curriculum", None),
    ("GET", "/metrics", None),
    ("POST", "/sample", {"iteration": 0, "batch_size": 2}),
    ("POST", "/grade", {"items": []}),
    ("GET", "/openapi.json", None),
]


async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "curriculum": "tiny", "last_iteration": None}


async def test_metrics_exposition(client: httpx.AsyncClient) -> None:
    await client.post("/sample", json={"iteration": 0, "batch_size": 2})
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for line in (
        'proctor_requests_total{method="POST",route="/sample",status="200"} 1.0',
        'proctor_samples_total{source="add",stage="warm"} 2.0',
        "proctor_current_stage 0.0",
        'proctor_stage_active{stage="warm"} 1.0',
        'proctor_stage_active{stage="main"} 0.0',
        "proctor_last_iteration 0.0",
        "proctor_serving 1.0",
        "# TYPE proctor_request_duration_seconds histogram",
        "# TYPE proctor_reward histogram",
    ):
        assert line in text


async def test_unmatched_paths_share_one_metrics_label(client: httpx.AsyncClient) -> None:
    for path in ("/nope", "/also/nope"):
        assert (await client.get(path)).status_code == 404
    text = (await client.get("/metrics")).text
    assert 'proctor_requests_total{method="GET",route="unmatched",status="404"} 2.0' in text


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p for _, p, _ in PROTECTED])
async def test_api_key_is_required_everywhere_but_healthz(
    open_client: Callable[..., Any], method: str, path: str, body: Any
) -> None:
    async with open_client(api_key="s3cret") as c:
        missing = await c.request(method, path, json=body)
        wrong = await c.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        right = await c.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
        health = await c.get("/healthz")
    assert missing.status_code == 401
    assert missing.json()["detail"].startswith("Authorization: missing")
    assert missing.headers["www-authenticate"] == "Bearer"
    assert wrong.status_code == 401
    assert wrong.json()["detail"] == "Authorization: the bearer token does not match this server's PROCTOR_API_KEY"
    assert right.status_code == 200
    assert health.status_code == 200


async def test_openapi_documents_the_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    assert {"/sample", "/grade", "/meta", "/curriculum", "/healthz", "/metrics"} <= set(spec["paths"])


async def test_a_failed_state_write_stops_the_server_cleanly(
    open_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, database: str
) -> None:
    import sqlite3

    from proctor.server.store import Store

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    async with open_client() as c:
        assert (await c.post("/sample", json={"iteration": 0, "batch_size": 2})).status_code == 200
        monkeypatch.setattr(Store, "record_iterations", refuse)
        failed = await c.post("/sample", json={"iteration": 1, "batch_size": 2})
        assert failed.status_code == 503
        if database == "postgresql":
            # A database's server opens it again by itself (tests/e2e/test_postgresql_outage.py).
            assert failed.json()["detail"].endswith("stopped accepting writes (database or disk is full); reconnecting")
            return
        assert "stopped accepting writes (database or disk is full); restart the server" in failed.json()["detail"]
        # Everything that needs the state now refuses, and /healthz says so.
        assert (await c.post("/sample", json={"iteration": 0, "batch_size": 2})).status_code == 503
        assert (await c.post("/grade", json={"items": []})).status_code == 503
        health = await c.get("/healthz")
        assert health.status_code == 503
        assert "restart the server" in health.json()["detail"]


async def test_new_iterations_that_arrive_together_are_committed_together(
    open_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from proctor.server.store import Store

    groups: list[list[int]] = []
    record = Store.record_iterations

    def spy(self: Store, entries: Any) -> None:
        groups.append([row.iteration for row, _, _ in entries])
        record(self, entries)

    monkeypatch.setattr(Store, "record_iterations", spy)
    async with open_client(state_sync="full") as c:
        answers = await asyncio.gather(*(c.post("/sample", json={"iteration": i, "batch_size": 2}) for i in range(16)))
        assert [a.status_code for a in answers] == [200] * 16
        # Every iteration was committed before it was answered, each exactly once, and fewer commits than
        # iterations: those that arrived while a commit waited for its fsync went in one transaction.
        assert sorted(i for group in groups for i in group) == list(range(16))
        assert len(groups) < 16
