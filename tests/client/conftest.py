"""Shared by the client tests: a ``/meta`` answer for scripted (``httpx.MockTransport``) servers, and a real
HTTP transport that keeps the requests it sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def meta() -> dict[str, Any]:
    """A ``/meta`` answer of a small curriculum, fresh for each test (a test may edit it)."""
    return {
        "total_iterations": 30,
        "stages": [{"name": "warm", "until_step": 10}, {"name": "main", "until_step": 30}],
        "curriculum": "tiny",
        "curriculum_hash": "c0ffee",
        "seed": 5,
        "run": "tiny-c0ffee",
        "sources": [{"name": "add", "kind": "arithmetic", "version": "v1", "size": None, "graders": ["numeric"]}],
        "max_batch_size": 64,
        "max_grade_items": 100,
        "max_body_bytes": 65536,
        "version": "0.1.0",
    }


@pytest.fixture
def with_meta(meta: dict[str, Any]) -> Callable[[Handler], httpx.MockTransport]:
    """``with_meta(handler)``: a transport that answers ``GET /meta`` with ``meta`` itself and passes every other
    request to ``handler``; the client reads its /grade limits from /meta before its first /grade, which a
    scripted server would otherwise have to answer too."""

    def transport(handler: Handler) -> httpx.MockTransport:
        return httpx.MockTransport(lambda r: httpx.Response(200, json=meta) if r.url.path == "/meta" else handler(r))

    return transport


class _Recording(httpx.HTTPTransport):
    def __init__(self, sent: list[httpx.Request]) -> None:
        super().__init__()
        self.sent = sent

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return super().handle_request(request)


@pytest.fixture
def sent() -> list[httpx.Request]:
    """Every request the ``recording`` transport has sent, in order."""
    return []


@pytest.fixture
def recording(sent: list[httpx.Request]) -> httpx.BaseTransport:
    """A real HTTP transport (for a live server) that appends each request it sends to ``sent``."""
    return _Recording(sent)
