"""LLM judges end to end: ``proctor serve`` processes whose curricula declare judges, graded through ``/grade``
against a real OpenAI-compatible server here (``transformers serve`` with the tiny offline model, whose answers
are noise: the tests check the plumbing, the cap and the failure verdicts, not the scores) and against real
loopback servers that misbehave on purpose (they hang, ask to slow down, fail, or check the API key). A
``proctor grade-worker`` runs the judges the same way for a server without grader processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.judge import LoopbackServer, ProxyServer, Reply, Request, chat_answer, judge_model, transformers_serve
from proctor.cli.launcher import ServerProcess

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-judge-4b7d91c0aa"
SERVER_KEY = "server-key-e2e"
GRADE_TIMEOUT_S = 300.0  # a liveness bound: every /grade below ends far sooner
NOISE = {"score_pattern": r"(\d)", "scale": [0, 9]}  # the first digit of the tiny model's noise, if any
NEVER = {"score_pattern": r"(\d)(?!)"}  # a pattern that can match nothing


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``transformers serve`` with the tiny model: its address and the model's name."""
    folder = tmp_path_factory.mktemp("transformers")
    model = judge_model(folder / "tiny")
    with transformers_serve(model, folder / "transformers.log") as url:
        yield url, str(model)


def curriculum(tmp_path: Path, judges: dict[str, dict[str, Any]], sources: dict[str, list[Any]]) -> Path:
    doc = {
        "name": "judged",
        "seed": 5,
        "sources": {name: {"kind": "arithmetic", "on_error": -1.0, "graders": uses} for name, uses in sources.items()},
        "graders": {name: {"judge": spec} for name, spec in judges.items()},
        "stages": [{"name": "only", "until_step": 100, "mix": [{"source": name} for name in sources]}],
    }
    path = tmp_path / "judged.yaml"
    path.write_text(json.dumps(doc))
    return path


def grade(server: ServerProcess, batch_size: int, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Sample step 0 and grade one completion of each prompt: each result beside its source's name."""
    with httpx.Client(base_url=server.url, headers=headers, timeout=GRADE_TIMEOUT_S) as http:
        samples = http.post("/sample", json={"iteration": 0, "batch_size": batch_size}).json()["samples"]
        items = [{"sample_id": s["sample_id"], "completion": f"The answer is {n}."} for n, s in enumerate(samples)]
        answer = http.post("/grade", json={"iteration": 0, "items": items})
        answer.raise_for_status()
        results: list[dict[str, Any]] = answer.json()["results"]
    return [{**r, "source": s["sample_id"].split(":")[0]} for s, r in zip(samples, results, strict=True)]


def test_a_real_judge_grades_within_its_cap(
    upstream: tuple[str, str], tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    url, model = upstream
    with ProxyServer(url).in_thread() as noisy, ProxyServer(url).in_thread() as muted:
        base = {
            "model": model,
            "max_tokens": 64,
            "temperature": 1.0,
            "max_concurrency": 2,
            "rubric": "{prompt} {response}",
        }
        path = curriculum(
            tmp_path,
            {"noise": {**base, **NOISE, "url": noisy.url + "/v1"}, "mute": {**base, **NEVER, "url": muted.url + "/v1"}},
            {"judged": ["noise"], "refused": ["mute"]},
        )
        server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"])
        results = grade(server, 16)
    judged = [r for r in results if r["source"] == "judged"]
    refused = [r for r in results if r["source"] == "refused"]
    assert len(judged) >= 3 and len(refused) >= 3  # the curriculum's seed mixes them so
    for r in judged:
        if r["error"] is None:
            assert 0.0 <= r["reward"] <= 1.0 and r["components"] == {"noise": r["reward"]}
            said = r["details"]["noise"]  # what the judge said: its own score, and its answer
            assert isinstance(said["score"], float) and isinstance(said["answer"], str)
        else:  # noise without a digit in it
            assert r["error"].startswith("judge 'noise': no score in its answer: ") and r["reward"] == -1.0
    assert any(r["error"] is None for r in judged)
    for r in refused:
        assert r["error"].startswith("judge 'mute': no score in its answer: ") and r["reward"] == -1.0
    # Every completion was one request, and never more than the cap at once, though all were sent together.
    assert (len(noisy.requests), noisy.max_in_flight) == (len(judged), 2)
    assert (len(muted.requests), muted.max_in_flight) == (len(refused), 2)
    assert all(r.json()["model"] == model for r in noisy.requests)


def test_the_key_goes_to_the_judge_and_nowhere_else(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    async def checked(request: Request) -> Reply:
        if request.path.startswith("/echo"):  # a judge that quotes the header it refuses
            return Reply(401, f"invalid key {request.headers.get('authorization')}".encode())
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return Reply(401, b"no key")
        return chat_answer("A fair answer.\nScore: 7")

    with LoopbackServer(checked).in_thread() as judge:
        path = curriculum(
            tmp_path,
            {"keyed": {"url": judge.url + "/v1", "model": "m"}, "echo": {"url": judge.url + "/echo", "model": "m"}},
            {"add": ["keyed"], "leaky": ["echo"]},
        )
        args = [
            str(path),
            "--database-url",
            str(tmp_path / "state.db"),
            "--grader-workers",
            "1",
            "--log-level",
            "debug",
        ]
        server = server_process(args, env={"PROCTOR_JUDGE_API_KEY": KEY, "PROCTOR_API_KEY": SERVER_KEY})
        auth = {"authorization": f"Bearer {SERVER_KEY}"}
        results = grade(server, 12, auth)
        shown = [httpx.get(server.url + route, headers=auth).text for route in ("/graders", "/dashboard", "/metrics")]
    keyed = [r for r in results if r["source"] == "add"]
    leaky = [r for r in results if r["source"] == "leaky"]
    assert keyed and leaky
    assert all(r["reward"] == pytest.approx(0.7) and r["error"] is None for r in keyed)
    assert all(r["error"] == "judge 'echo' answered HTTP 401: invalid key Bearer **********" for r in leaky)
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in judge.requests)
    assert json.loads(shown[0])["sources"]["add"]["judges"][0]["name"] == "keyed"
    for text in [*shown, server.output(), json.dumps(results)]:
        assert KEY not in text


def test_a_judge_that_hangs_gives_timeout_verdicts(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    async def never(request: Request) -> None:
        return None

    with LoopbackServer(never).in_thread() as judge:
        spec = {"url": judge.url + "/v1", "model": "m", "max_concurrency": 2, "timeout_s": 1, "deadline_s": 2}
        path = curriculum(tmp_path, {"stuck": spec}, {"add": ["stuck", "numeric"]})
        server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"])
        graded: list[list[dict[str, Any]]] = []
        grading = threading.Thread(target=lambda: graded.append(grade(server, 6)))
        grading.start()
        health: list[int] = []
        while grading.is_alive() and len(health) < 10_000:
            health.append(httpx.get(server.url + "/healthz", timeout=5).status_code)
            time.sleep(0.05)
        grading.join(GRADE_TIMEOUT_S)
        metrics = httpx.get(server.url + "/metrics").text
    assert health and set(health) == {200}  # the server answered all along
    [results] = graded
    timed_out = (
        "judge 'stuck' did not answer within 1s",
        "judge 'stuck' gave no verdict within its deadline of 2s",
    )
    for r in results:
        assert r["error"] in timed_out and r["reward"] == -1.0 and "numeric" in r["components"]
    assert re.search(r'proctor_grader_errors_total\{grader="stuck",kind="timeout"\} 6\.0', metrics)


def test_a_judge_is_tried_again_after_a_429_and_gives_up_after_its_retries(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    served = 0

    async def flaky(request: Request) -> Reply:
        nonlocal served
        served += 1  # one slot: each completion's first request is told to slow down, its second is answered
        return Reply(429, b"slow down", {"retry-after": "0"}) if served % 2 else chat_answer("[[4]]")

    async def broken(request: Request) -> Reply:
        return Reply(500, b"out of memory")

    with LoopbackServer(flaky).in_thread() as slow, LoopbackServer(broken).in_thread() as down:
        path = curriculum(
            tmp_path,
            {
                "flaky": {"url": slow.url + "/v1", "model": "m", "max_concurrency": 1},
                "broken": {"url": down.url + "/v1", "model": "m", "retries": 2},
            },
            {"add": ["flaky", "broken"]},
        )
        server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"])
        results = grade(server, 3)
    for r in results:
        assert r["components"] == {"flaky": pytest.approx(0.4)}
        assert r["error"] == "judge 'broken' answered HTTP 500: out of memory (3 of 3 tries)"
    assert (len(slow.requests), len(down.requests)) == (6, 9)


def test_a_grade_worker_runs_the_judges_with_its_own_key(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    async def checked(request: Request) -> Reply:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return Reply(401, b"no key")
        return chat_answer("Score: 9")

    with LoopbackServer(checked).in_thread() as judge:
        path = curriculum(tmp_path, {"keyed": {"url": judge.url + "/v1", "model": "m"}}, {"add": ["keyed"]})
        # The server's own key is not the worker's: GET /graders never carries it.
        server = server_process([str(path), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "0"])
        log = tmp_path / "worker.log"
        cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", server.url, "--workers", "1"]
        with log.open("ab") as out:
            worker = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PROCTOR_JUDGE_API_KEY": KEY}
            )
        try:
            results = grade(server, 4)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    assert [r["reward"] for r in results] == [pytest.approx(0.9)] * 4
    assert len(judge.requests) == 4
    assert KEY not in log.read_text() and KEY not in server.output()
