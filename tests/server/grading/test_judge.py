"""LLM judges (proctor.server.grading.judge): how a curriculum declares one, the rubric and the score, and the
client's behaviour against real HTTP servers on loopback (bench.judge.LoopbackServer): its cap, its retries, its
time limits, its failure verdicts and its API key. The judge against a real model is tests/e2e/test_judge.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import SecretStr, ValidationError

from bench.judge import LoopbackServer, Reply, Request, chat_answer
from proctor.cli.launcher import free_port
from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grade_worker import source_graders
from proctor.server.grading.base import GradeInput
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.judge import JudgeClient, read_score, render_rubric
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import JudgeGrader, LocalGrader, SourceGraders
from proctor.server.metrics import Metrics
from proctor.server.regrade import grader_version, only_grader
from proctor.server.services.views import graders as graders_view
from proctor.server.settings import load_settings
from proctor.server.spec import (
    DEFAULT_JUDGE_SCORE_PATTERN,
    CurriculumError,
    CustomGraderSpec,
    JudgeSpec,
    judge_rubric_problem,
)
from proctor.wire.dataserver import Graders

pytestmark = pytest.mark.anyio

KEY = "sk-judge-7f3a9c1e5b"
SAMPLE = GradeInput(prompt="What is 2+2?", completion="<think>two and two</think>4", answer="4")
HANG_GUARD_S = 30.0  # a liveness bound: every wait below ends far sooner


def judge(origin: str, **fields: Any) -> JudgeGrader:
    """A judge at ``origin``'s /v1 (``url=`` for another URL)."""
    values: dict[str, Any] = {
        "key": "quality",
        "name": "quality",
        "url": origin + "/v1",
        "model": "judge-model",
        "rubric": "Q: {prompt}\nA: {response}\nScore it.",
        "score_pattern": DEFAULT_JUDGE_SCORE_PATTERN,
        "scale": (0.0, 10.0),
        "max_concurrency": 4,
        "timeout_s": 10.0,
        "deadline_s": 20.0,
        "retries": 2,
        "max_tokens": 64,
        "temperature": 0.0,
        "weight": 1.0,
        "multiplicative": False,
    }
    return JudgeGrader(**{**values, **fields})


def answering(text: str) -> Callable[[Request], Any]:
    async def handler(request: Request) -> Reply:
        return chat_answer(text)

    return handler


def in_turn(*replies: Reply | None) -> Callable[[Request], Any]:
    """Each request gets the next reply; the last one is repeated."""
    served = 0

    async def handler(request: Request) -> Reply | None:
        nonlocal served
        served += 1
        return replies[min(served, len(replies)) - 1]

    return handler


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
async def client() -> AsyncIterator[Callable[..., JudgeClient]]:
    """``client(key=None, **options)``: a judge client, closed when the test ends."""
    made: list[JudgeClient] = []

    def make(key: str | None = None, **options: Any) -> JudgeClient:
        # Short backoffs: the retry tests wait for them.
        judges = JudgeClient(SecretStr(key) if key else None, **{"backoff_s": 0.01, "max_backoff_s": 0.05, **options})
        made.append(judges)
        return judges

    yield make
    for judges in made:
        await judges.aclose()


# --- the curriculum's declaration ------------------------------------------------------------------------------


def test_a_judge_entry_takes_its_defaults() -> None:
    spec = CustomGraderSpec.model_validate({"judge": {"url": "http://vllm:8000/v1", "model": "qwen"}})
    assert spec.judge is not None
    j = spec.judge
    assert (j.scale, j.max_concurrency, j.retries, j.temperature) == ((0.0, 10.0), 8, 3, 0.0)
    assert (j.timeout_s, j.deadline_s, j.max_tokens) == (60.0, 300.0, 512)
    assert judge_rubric_problem(j.rubric) is None and "{response}" in j.rubric


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rubric": "{prompt} {reply}"},
            "unknown placeholder {reply}; a rubric may name {prompt}, {completion}, {response}, {answer}",
        ),
        ({"rubric": "{prompt.__class__} {response}"}, "unknown placeholder {prompt.__class__}"),
        ({"rubric": "{response:>9}"}, "unknown placeholder {response:>9}"),
        ({"rubric": "Grade {prompt} against {answer}."}, "names neither {completion} nor {response}"),
        ({"rubric": '{"score": {response}'}, "not a valid template"),
        ({"score_pattern": r"(\d)/(\d)"}, "must have exactly one group, the score; it has 2"),
        ({"score_pattern": r"Score: \d"}, "must have exactly one group, the score; it has 0"),
        ({"score_pattern": "(["}, "not a regular expression"),
        ({"scale": [10, 1]}, "must be [min, max] with min < max, got [10.0, 1.0]"),
        ({"max_concurrency": 0}, "greater than or equal to 1"),
        ({"max_concurrency": 257}, "less than or equal to 256"),
        ({"retries": 11}, "less than or equal to 10"),
        ({"timeout_s": 30, "deadline_s": 10}, "deadline_s (10) is below timeout_s (30)"),
    ],
    ids=[
        "unknown-placeholder",
        "attribute",
        "format-spec",
        "no-completion",
        "lone-brace",
        "two-groups",
        "no-group",
        "bad-regex",
        "scale-order",
        "cap-zero",
        "cap-high",
        "retries-high",
        "deadline",
    ],
)
def test_a_bad_judge_field_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        JudgeSpec.model_validate({"url": "http://vllm:8000/v1", "model": "qwen", **fields})
    assert message in str(info.value)


def test_literal_braces_are_doubled() -> None:
    rubric = 'Answer as JSON, {{"score": N}}.\n{response}'
    assert judge_rubric_problem(rubric) is None
    assert render_rubric(rubric, SAMPLE) == 'Answer as JSON, {"score": N}.\n4'


def write(tmp_path: Path, graders: dict[str, Any], uses: list[Any]) -> Path:
    doc = {
        "name": "judged",
        "sources": {"add": {"kind": "arithmetic", "graders": uses}},
        "graders": graders,
        "stages": [{"name": "only", "until_step": 10, "mix": [{"source": "add"}]}],
    }
    path = tmp_path / "judged.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


JUDGE = {"judge": {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m"}}}


@pytest.mark.parametrize(
    ("graders", "uses", "problem"),
    [
        (
            {"quality": {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "{question} {response}"}}},
            ["quality"],
            ("graders.quality.judge.rubric", "unknown placeholder {question}"),
        ),
        (
            JUDGE,
            [{"name": "judge", "params": {"rubric": "Is {completion} right? {reference}"}}],
            ("sources.add.graders[0].params.rubric", "unknown placeholder {reference}"),
        ),
        (
            JUDGE,
            [{"name": "judge", "params": {"temperature": 1.0}}],
            ("sources.add.graders[0].params.temperature", "takes only rubric, score_pattern and scale"),
        ),
        (
            JUDGE,
            [{"name": "judge", "params": {"scale": [1, 1]}}],
            ("sources.add.graders[0].params.scale", "must be [min, max] with min < max"),
        ),
        (
            {"quality": {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m"}, "headers": {"X": "y"}}},
            ["quality"],
            ("graders.quality", "a judge takes its settings inside `judge:`, not `headers` beside it"),
        ),
        (
            {"quality": {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m"}, "python": "pkg:fn"}},
            ["quality"],
            (
                "graders.quality",
                "give exactly one of `python: module:attr`, `url: http://…` or `judge: {url, model, …}`",
            ),
        ),
    ],
    ids=["rubric", "source-rubric", "source-param", "source-scale", "stray-field", "two-kinds"],
)
def test_a_bad_judge_is_refused_when_the_curriculum_loads(
    tmp_path: Path, graders: dict[str, Any], uses: list[Any], problem: tuple[str, str]
) -> None:
    with pytest.raises(CurriculumError) as info:
        load_curriculum(write(tmp_path, graders, uses))
    [(path, message)] = info.value.problems
    assert path == problem[0]
    assert problem[1] in message


def test_a_source_sets_its_own_rubric_and_shares_the_judges_cap(tmp_path: Path) -> None:
    doc = {
        "name": "judged",
        "sources": {
            "add": {"kind": "arithmetic", "graders": ["numeric", {"name": "judge", "weight": 2}]},
            "mul": {
                "kind": "arithmetic",
                "ops": ["*"],
                "graders": [
                    {"name": "judge", "id": "style", "params": {"rubric": "{prompt} => {completion}", "scale": [1, 5]}}
                ],
            },
        },
        "graders": {"judge": {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m", "max_concurrency": 3}}},
        "stages": [{"name": "only", "until_step": 10, "mix": [{"source": "add"}, {"source": "mul"}]}],
    }
    path = tmp_path / "judged.yaml"
    path.write_text(yaml.safe_dump(doc))
    c = load_curriculum(path)
    [add] = c.graders["add"].judges
    [mul] = c.graders["mul"].judges
    assert c.graders["add"].names == ("numeric", "judge")
    assert (add.key, add.name, add.weight, add.scale) == ("judge", "judge", 2.0, (0.0, 10.0))
    assert (mul.key, mul.name, mul.rubric, mul.scale) == ("style", "judge", "{prompt} => {completion}", (1.0, 5.0))
    assert add.max_concurrency == mul.max_concurrency == 3
    # A grade-worker rebuilds the same graders from GET /graders, and the regrade of one grader keeps its judge.
    settings = load_settings(curriculum=path, judge_api_key=KEY, api_key="server-key")
    answer = graders_view(c, settings).model_dump_json()
    assert KEY not in answer
    assert source_graders(Graders.model_validate_json(answer)) == c.graders
    [(source, only)] = only_grader(c.graders, "style").items()
    assert source == "mul" and only.judges == (dataclasses.replace(mul, weight=1.0),)
    # A score depends on the judge: another rubric is another regrade version.
    other = {
        **c.graders,
        "mul": dataclasses.replace(c.graders["mul"], judges=(dataclasses.replace(mul, rubric="{completion}"),)),
    }
    assert grader_version(other) != grader_version(c.graders)


def test_the_example_of_the_curricula_page_loads(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parents[3] / "docs" / "curricula.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL) if "max_concurrency" in b]
    path = tmp_path / "judged.yaml"
    path.write_text(block)
    c = load_curriculum(path)
    [add] = c.graders["add"].judges
    [explain] = c.graders["explain"].judges
    assert (add.name, add.url, add.max_concurrency, add.scale) == ("quality", "http://vllm:8000/v1", 16, (0.0, 10.0))
    assert explain.scale == (1.0, 5.0) and "{answer}" in explain.rubric
    sample = GradeInput(prompt="Explain 2+2", completion="<think>hm</think>Add them: 4.", answer="4")
    assert render_rubric(explain.rubric, sample).splitlines()[:3] == [
        "Task: Explain 2+2",
        "Expected result: 4",
        "Explanation: Add them: 4.",
    ]


def test_the_key_is_a_secret_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_JUDGE_API_KEY", KEY)
    settings = load_settings()
    assert settings.judge_api_key is not None and settings.judge_api_key.get_secret_value() == KEY
    assert KEY not in repr(settings) and KEY not in str(settings)


# --- the rubric and the score --------------------------------------------------------------------------------


def test_the_rubric_is_filled_in() -> None:
    rubric = "{prompt}|{completion}|{response}|{answer}"
    assert render_rubric(rubric, SAMPLE) == "What is 2+2?|<think>two and two</think>4|4|4"
    # Braces in what is filled in stay as they are.
    assert render_rubric(rubric, GradeInput(prompt="{answer}", completion="{x}", answer="{}")) == "{answer}|{x}|{x}|{}"


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("Good.\nScore: 7", 0.7),
        ("score = 7.5", 0.75),
        ("**Score:** 10", 1.0),
        ("Rating: [[3]]", 0.3),
        ("Score: 2 at first; on reflection, Score: 9", 0.9),  # the last one counts
        ("<think>Score: 1? no</think>Final Score: 4", 0.4),  # a reasoning judge's thoughts do not
        ("Score: 0", 0.0),
    ],
)
def test_the_last_score_in_the_answer_counts(answer: str, score: float) -> None:
    outcome = read_score(judge("http://x"), answer)
    assert outcome.score == pytest.approx(score)


def test_an_answer_without_a_score_is_a_clear_failure() -> None:
    noise = "I cannot decide. " * 30
    outcome = read_score(judge("http://x"), noise)
    assert outcome.failure is FailureKind.ERROR
    assert outcome.message == f"judge 'quality': no score in its answer: {noise.strip()[:200]!r}"
    assert read_score(judge("http://x"), "").message == "judge 'quality': no score in its answer: ''"


def test_a_score_off_the_scale_is_a_failure() -> None:
    outcome = read_score(judge("http://x", scale=(1.0, 5.0)), "Score: 7")
    assert outcome == GraderOutcome.failed(
        FailureKind.ERROR, "judge 'quality': its score 7 is outside its scale [1, 5]"
    )
    assert read_score(judge("http://x", scale=(1.0, 5.0)), "Score: 4").score == 0.75
    odd = read_score(judge("http://x", score_pattern=r"verdict: (\w+)"), "verdict: great")
    assert odd == GraderOutcome.failed(FailureKind.ERROR, "judge 'quality': its score 'great' is not a number")


# --- the client, against real servers on loopback ---------------------------------------------------------------


async def test_one_chat_completion_per_completion(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(answering("Fine work. Score: 8")) as server:
        items = [SAMPLE, dataclasses.replace(SAMPLE, completion="5")]
        outcomes = await client(KEY).grade(judge(server.url), items)
    assert [o.score for o in outcomes] == [0.8, 0.8]
    assert len(server.requests) == 2
    request = server.requests[0]
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.json() == {
        "model": "judge-model",
        "messages": [{"role": "user", "content": "Q: What is 2+2?\nA: 4\nScore it."}],
        "max_tokens": 64,
        "temperature": 0.0,
    }
    assert server.requests[1].json()["messages"][0]["content"] == "Q: What is 2+2?\nA: 5\nScore it."


async def test_no_key_no_authorization_header(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(answering("Score: 8")) as server:
        # A URL that already names the route is taken as it is.
        await client().grade(judge(server.url, url=server.url + "/v1/chat/completions/"), [SAMPLE])
    assert "authorization" not in server.requests[0].headers
    assert server.requests[0].path == "/v1/chat/completions"


async def test_the_cap_holds_across_every_grade_at_once(client: Callable[..., JudgeClient]) -> None:
    release = asyncio.Event()

    async def held(request: Request) -> Reply:
        await release.wait()
        return chat_answer("Score: 5")

    judges = client()
    async with LoopbackServer(held) as server:
        # Two /grade requests' worth of completions, from two sources whose uses of the judge differ.
        first = asyncio.create_task(judges.grade(judge(server.url, max_concurrency=3), [SAMPLE] * 10))
        second = asyncio.create_task(
            judges.grade(judge(server.url, max_concurrency=3, key="style", rubric="{completion}"), [SAMPLE] * 10)
        )
        async with asyncio.timeout(HANG_GUARD_S):
            while server.in_flight < 3:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # time for a request past the cap to arrive, were there one
        assert server.in_flight == 3
        release.set()
        outcomes = [*await first, *await second]
    assert [o.score for o in outcomes] == [0.5] * 20
    assert (server.max_in_flight, len(server.requests)) == (3, 20)


async def test_a_slot_keeps_its_connection_until_the_client_closes(client: Callable[..., JudgeClient]) -> None:
    judges = client()
    async with LoopbackServer(answering("Score: 5")) as server:
        wide = judge(server.url, max_concurrency=16)
        # One completion at a time: however wide the cap, one connection serves them all.
        for _ in range(5):
            await judges.grade(wide, [SAMPLE])
        assert (server.connections, len(server.requests)) == (1, 5)
        # At once: a connection a slot at the most.
        await judges.grade(wide, [SAMPLE] * 64)
        assert 1 <= server.connections <= 16
        await judges.aclose()
        async with asyncio.timeout(HANG_GUARD_S):
            while server.open_connections:  # the judge saw each connection close
                await asyncio.sleep(0.01)
        # A closed client opens connections again when asked.
        await judges.grade(wide, [SAMPLE])
    assert len(server.requests) == 5 + 64 + 1


async def test_a_429_is_tried_again_after_its_retry_after(client: Callable[..., JudgeClient]) -> None:
    busy = Reply(429, {"error": "slow down"}, {"retry-after": "0"})
    async with LoopbackServer(in_turn(busy, busy, chat_answer("Score: 6"))) as server:
        [outcome] = await client().grade(judge(server.url), [SAMPLE])
    assert outcome.score == 0.6
    assert len(server.requests) == 3


async def test_a_5xx_is_tried_again_with_backoff(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(in_turn(Reply(503, b"warming up"), chat_answer("Score: 6"))) as server:
        [outcome] = await client().grade(judge(server.url), [SAMPLE])
    assert outcome.score == 0.6
    assert len(server.requests) == 2


async def test_a_judge_that_keeps_failing_fails_after_its_retries(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(in_turn(Reply(500, b"kaput"))) as server:
        [outcome] = await client().grade(judge(server.url, retries=2), [SAMPLE])
    assert outcome == GraderOutcome.failed(
        FailureKind.REMOTE, "judge 'quality' answered HTTP 500: kaput (3 of 3 tries)"
    )
    assert len(server.requests) == 3


async def test_another_4xx_is_not_tried_again(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(in_turn(Reply(400, {"error": "unknown model"}))) as server:
        [outcome] = await client().grade(judge(server.url), [SAMPLE])
    assert outcome == GraderOutcome.failed(
        FailureKind.REMOTE, 'judge \'quality\' answered HTTP 400: {"error": "unknown model"}'
    )
    assert len(server.requests) == 1


async def test_an_unreachable_judge_is_tried_again_then_fails(client: Callable[..., JudgeClient]) -> None:
    [outcome] = await client().grade(judge(f"http://127.0.0.1:{free_port()}", retries=1), [SAMPLE])
    assert outcome.failure is FailureKind.REMOTE
    assert outcome.message.startswith("judge 'quality' unreachable: ConnectError")
    assert outcome.message.endswith("(2 of 2 tries)")


async def test_a_retry_that_would_pass_the_deadline_is_not_made(client: Callable[..., JudgeClient]) -> None:
    slow_down = Reply(429, b"", {"retry-after": "3600"})
    judges = client(backoff_s=0.5, max_backoff_s=3600)
    async with LoopbackServer(in_turn(slow_down)) as server:
        async with asyncio.timeout(HANG_GUARD_S):
            [outcome] = await judges.grade(judge(server.url, timeout_s=1.0, deadline_s=2.0, retries=5), [SAMPLE])
    assert outcome == GraderOutcome.failed(
        FailureKind.REMOTE,
        "judge 'quality' answered HTTP 429: ; its deadline came before the next try (1 of 6 tries)",
    )


async def test_a_judge_that_hangs_gives_timeouts(client: Callable[..., JudgeClient]) -> None:
    async def never(request: Request) -> None:
        return None

    async with LoopbackServer(never) as server:
        # One slot: the first completion's request hangs until its time limit, and the others wait for the slot
        # until their deadline.
        hanging = judge(server.url, max_concurrency=1, timeout_s=0.5, deadline_s=0.8)
        async with asyncio.timeout(HANG_GUARD_S):
            outcomes = await client().grade(hanging, [SAMPLE] * 3)
    assert outcomes[0] == GraderOutcome.failed(FailureKind.TIMEOUT, "judge 'quality' did not answer within 0.5s")
    waited = GraderOutcome.failed(FailureKind.TIMEOUT, "judge 'quality' gave no verdict within its deadline of 0.8s")
    assert outcomes[1:] == [waited, waited]


async def test_a_request_past_its_time_limit_is_not_tried_again(client: Callable[..., JudgeClient]) -> None:
    async def never(request: Request) -> None:
        return None

    async with LoopbackServer(never) as server:
        async with asyncio.timeout(HANG_GUARD_S):
            [outcome] = await client().grade(judge(server.url, timeout_s=0.3, deadline_s=60), [SAMPLE])
    assert outcome == GraderOutcome.failed(FailureKind.TIMEOUT, "judge 'quality' did not answer within 0.3s")
    assert len(server.requests) == 1


async def test_a_rubric_that_needs_the_answer_fails_a_record_without_one(client: Callable[..., JudgeClient]) -> None:
    async with LoopbackServer(answering("Score: 9")) as server:
        with_answer = judge(server.url, rubric="{response} vs {answer}")
        outcomes = await client().grade(with_answer, [SAMPLE, dataclasses.replace(SAMPLE, answer=None)])
    assert outcomes == [
        GraderOutcome.scored(0.9, {"score": 9.0, "answer": "Score: 9"}),
        GraderOutcome.failed(
            FailureKind.ERROR, "judge 'quality': its rubric names {answer}, and this record has no reference answer"
        ),
    ]
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("reply", "outcome"),
    [
        (Reply(200, b"not json"), "judge 'quality' sent no chat completion (choices[0].message.content): not json"),
        (
            Reply(200, {"choices": []}),
            "judge 'quality' sent no chat completion (choices[0].message.content): {\"choices\": []}",
        ),
        (
            Reply(200, {"choices": [{"message": {"role": "assistant", "content": None}}]}),
            "judge 'quality': no score in its answer: ''",
        ),
    ],
    ids=["not-json", "no-choice", "null-content"],
)
async def test_an_answer_that_is_no_chat_completion(
    client: Callable[..., JudgeClient], reply: Reply, outcome: str
) -> None:
    async with LoopbackServer(in_turn(reply)) as server:
        [result] = await client().grade(judge(server.url), [SAMPLE])
    assert result.message == outcome and result.score is None


async def test_the_key_never_shows(client: Callable[..., JudgeClient], caplog: pytest.LogCaptureFixture) -> None:
    async def echo(request: Request) -> Reply:
        # A judge that quotes the header it refused.
        return Reply(
            401 if "retry" not in request.path else 500, f"bad key: {request.headers['authorization']}".encode()
        )

    judges = client(KEY)
    assert KEY not in repr(judges)
    with caplog.at_level(logging.DEBUG):
        async with LoopbackServer(echo) as server:
            refused = await judges.grade(judge(server.url), [SAMPLE])
            retried = await judges.grade(judge(server.url + "/retry"), [SAMPLE])
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert refused[0].message == "judge 'quality' answered HTTP 401: bad key: Bearer **********"
    assert KEY not in retried[0].message and "**********" in retried[0].message
    assert len(server.requests) == 1 + 3
    assert caplog.records and all(KEY not in r.getMessage() for r in caplog.records)


# --- through the fanout and /grade ------------------------------------------------------------------------------


async def test_the_fanout_calls_judges_beside_the_local_graders(http: httpx.AsyncClient) -> None:
    pool = GraderPool(1)
    await pool.start()
    try:
        async with LoopbackServer(answering("Score: 3")) as server:
            exact = LocalGrader("exact_match", "builtin:exact_match", {}, 1.0, False)
            graders = SourceGraders((exact,), (), 0.0, ("exact_match", "quality"), (judge(server.url),))
            fanout = GraderFanout(pool, http, Metrics(), 10.0, judge_api_key=SecretStr(KEY))
            try:
                outcomes = await fanout.grade(
                    [(graders, SAMPLE), (graders, dataclasses.replace(SAMPLE, completion="5"))]
                )
            finally:
                await fanout.aclose()
    finally:
        await pool.close()
    said = {"score": 3.0, "answer": "Score: 3"}  # the judge's own score and words: the result's details
    assert outcomes == [
        {"exact_match": GraderOutcome.scored(1.0), "quality": GraderOutcome.scored(0.3, said)},
        {"exact_match": GraderOutcome.scored(0.0), "quality": GraderOutcome.scored(0.3, said)},
    ]
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


async def test_a_curriculum_with_a_judge(tmp_path: Path, open_client: Callable[..., Any]) -> None:
    async def by_length(request: Request) -> Reply:
        # The completion's length as its score: "7.0" gets 3 of 4.
        content = request.json()["messages"][0]["content"]
        return chat_answer(f"[[{len(content.rsplit('=> ', 1)[1])}]]")

    async with LoopbackServer(by_length) as server:
        graders = {
            "judge": {
                "judge": {"url": server.url + "/v1", "model": "m", "rubric": "{prompt} => {response}", "scale": [0, 4]}
            }
        }
        path = write(tmp_path, graders, [{"name": "judge", "weight": 3}, {"name": "numeric", "weight": 1}])
        async with open_client(curriculum=path, judge_api_key=KEY, api_key="server-key") as c:
            c.headers["authorization"] = "Bearer server-key"
            samples = (await c.post("/sample", json={"iteration": 0, "batch_size": 4})).json()["samples"]
            items = [{"sample_id": s["sample_id"], "completion": "7.0"} for s in samples]
            results = (await c.post("/grade", json={"items": items})).json()["results"]
            shown = (await c.get("/graders")).text
    for s, r in zip(samples, results, strict=True):
        right = eval(s["metadata"]["expression"]) == 7
        assert r["components"] == {"judge": 0.75, "numeric": float(right)}
        assert r["reward"] == (3 * 0.75 + right) / 4 and r["error"] is None
    assert len(server.requests) == 4
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in server.requests)
    assert KEY not in shown and json.loads(shown)["sources"]["add"]["judges"][0]["url"] == server.url + "/v1"
