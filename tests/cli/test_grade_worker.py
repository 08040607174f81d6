"""``proctor grade-worker``'s start against a dataserver that goes away between answering ``/healthz`` and
answering ``GET /graders`` (it restarts), scripted with ``httpx.MockTransport``. The worker's loop itself, with
real servers and processes, is in ``tests/e2e/test_grade_workers.py``."""

from __future__ import annotations

import httpx
import pytest

from proctor.cli.grade_worker import server_graders
from proctor.cli.main import build_parser
from proctor.client import ProctorClient
from proctor.client.errors import NotReadyError, TransportError

HEALTH = {"status": "ok", "curriculum": "workers", "last_iteration": None}
GRADERS = {"curriculum_hash": "0" * 16, "timeout_s": 30.0, "headers_withheld": False, "sources": {}}


def scripted(down_for: int, calls: list[str]) -> ProctorClient:
    """A server whose first ``down_for`` answers to ``GET /graders`` are refused connections."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/healthz":
            return httpx.Response(200, json=HEALTH)
        if calls.count("/graders") <= down_for:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=GRADERS)

    return ProctorClient("http://proctor.test", retries=2, transport=httpx.MockTransport(handler), sleep=lambda s: None)


def test_a_server_gone_between_its_readiness_and_its_graders_is_waited_for_again() -> None:
    calls: list[str] = []
    spec = server_graders(scripted(down_for=3, calls=calls), timeout_s=60.0)
    assert spec.curriculum_hash == "0" * 16
    # Three refused tries (a call and its two retries), readiness looked at again, then the answer.
    assert calls == ["/healthz", "/graders", "/graders", "/graders", "/healthz", "/graders"]


def test_a_server_that_never_comes_back_ends_the_wait_with_the_reason() -> None:
    client = ProctorClient(
        "http://proctor.test",
        retries=0,
        transport=httpx.MockTransport(lambda r: httpx.Response(503, json={"detail": "starting"})),
        sleep=lambda s: None,
    )
    with pytest.raises(NotReadyError, match=r"was not ready after 0s .*is `proctor serve` running there\?"):
        server_graders(client, timeout_s=0.0)


def test_graders_that_never_answer_end_the_wait_with_their_failure() -> None:
    calls: list[str] = []
    client = scripted(down_for=10**6, calls=calls)
    with pytest.raises(TransportError, match=r"GET http://proctor.test/graders failed after 3 attempts"):
        server_graders(client, timeout_s=0.0)
    assert calls == ["/healthz", "/graders", "/graders", "/graders"]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--tables-per-dispatch", "0", "0 is outside 1 to 64"),
        ("--tables-per-dispatch", "65", "65 is outside 1 to 64"),
        ("--tables-per-dispatch", "x", "'x' is not a whole number"),
        ("--rows-per-dispatch", "0", "0 is outside 1 to 65536"),
        ("--rows-per-dispatch", "65537", "65537 is outside 1 to 65536"),
        ("--rows-per-dispatch", "1.5", "'1.5' is not a whole number"),
    ],
)
def test_a_claim_size_the_server_would_refuse_is_refused_at_once(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["grade-worker", "--server", "http://127.0.0.1:1", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err
