"""remote_reward: matching by (slot, completion_index), errors, metrics, and a failing /grade."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypedDict

import httpx
import pytest

from proctor.client import ProctorClient, ServerFailure, remote_reward
from proctor.client.dataset import RemoteRLDataset

# The ``with_meta`` fixture (tests/client/conftest.py): a scripted /grade behind a transport that answers /meta.
WithMeta = Callable[[Callable[[httpx.Request], httpx.Response]], httpx.MockTransport]


@pytest.fixture
def client(
    live_server: Callable[..., AbstractContextManager[str]], recording: httpx.BaseTransport
) -> Iterator[ProctorClient]:
    """A client of a real server on the tiny curriculum; what it sends is kept in ``sent``."""
    with live_server() as url, ProctorClient(url, transport=recording) as c:
        yield c


def dataset(client: ProctorClient) -> RemoteRLDataset:
    """A dataset of 2 prompts × 2 completions a step, as a trainer's arguments would make it."""
    args = SimpleNamespace(
        per_device_train_batch_size=4, world_size=1, process_index=0, steps_per_generation=1,
        num_generations=2, shuffle_dataset=False, max_steps=5, num_train_epochs=1,
    )  # fmt: skip
    return RemoteRLDataset(client, args)


def columns(client: ProctorClient, iteration: int = 0, generations: int = 2) -> dict[str, list[Any]]:
    samples = client.sample(iteration, 2).samples
    return {
        "sample_id": [s.sample_id for s in samples for _ in range(generations)],
        "slot": [s.slot for s in samples for _ in range(generations)],
        "completion_index": [k for _ in samples for k in range(generations)],
        "iteration": [iteration] * (len(samples) * generations),
        "expressions": [s.metadata["expression"] for s in samples for _ in range(generations)],
    }


def test_rewards_follow_the_completions(client: ProctorClient) -> None:
    cols = columns(client)
    right = [str(eval(e)) for e in cols.pop("expressions")]
    completions = [r if k == 0 else "no" for r, k in zip(right, cols["completion_index"], strict=True)]
    metrics: list[tuple[str, float]] = []
    reward = remote_reward(client)
    rewards = reward(
        prompts=["p"] * 4,
        completions=completions,
        completion_ids=[[1, 2]] * 4,
        log_metric=lambda name, value: metrics.append((name, value)),
        **cols,
    )
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert ("proctor/numeric", 0.5) in metrics
    assert ("proctor/grading_errors", 0.0) in metrics
    assert ("proctor/iteration", 0.0) in metrics
    assert reward.__name__ == "proctor_reward"


def test_conversational_completions_and_token_counts(with_meta: WithMeta) -> None:
    sent: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        items = sent["items"]
        return httpx.Response(
            200,
            json={
                "results": [
                    {
                        "sample_id": i["sample_id"],
                        "slot": i["slot"],
                        "completion_index": i["completion_index"],
                        "reward": 1.0,
                    }
                    for i in items
                ]
            },
        )

    client = ProctorClient("http://proctor.test", transport=with_meta(handler))
    rewards = remote_reward(client)(
        prompts=[[{"role": "user", "content": "q"}]] * 2,
        completions=[[{"role": "assistant", "content": "four"}], [{"role": "assistant", "content": "4"}]],
        completion_ids=[[5, 6, 7], [8]],
        sample_id=["s:0123456789:1", "s:0123456789:1"],
        slot=[0, 0],
        completion_index=[0, 1],
        iteration=[7, 7],
    )
    assert rewards == [1.0, 1.0]
    assert sent["iteration"] == 7
    assert [(i["completion"], i["completion_tokens"]) for i in sent["items"]] == [("four", 3), ("4", 1)]


def test_results_are_matched_by_key_not_position(with_meta: WithMeta) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        items = json.loads(request.content)["items"]
        results = [
            {
                "sample_id": i["sample_id"],
                "slot": i["slot"],
                "completion_index": i["completion_index"],
                "reward": float(i["completion_index"]),
            }
            for i in reversed(items)
        ]
        return httpx.Response(200, json={"results": results})

    client = ProctorClient("http://proctor.test", transport=with_meta(handler))
    rewards = remote_reward(client)(
        prompts=["p"] * 3,
        completions=["a", "b", "c"],
        sample_id=["s:0123456789:1"] * 3,
        slot=[4, 4, 4],
        completion_index=[0, 1, 2],
        iteration=[0, 0, 0],
    )
    assert rewards == [0.0, 1.0, 2.0]


def test_a_record_in_two_slots_is_two_prompts(
    client: ProctorClient, curriculum_file: Path, sent: list[httpx.Request]
) -> None:
    # Iteration 10 is in stage `main`: 12 of its 16 prompts come from the 6-row `qa` source, so a record is
    # served twice: the same sample_id and completion_index under two slots, each graded and matched on its own.
    samples = client.sample(10, 16).samples
    slots: dict[str, list[int]] = {}
    for s in samples:
        slots.setdefault(s.sample_id, []).append(s.slot)
    sid, (first, second, *_) = next((k, v) for k, v in slots.items() if len(v) > 1)
    prompt = next(s.prompt for s in samples if s.sample_id == sid)
    qa = [json.loads(line) for line in (curriculum_file.parent / "qa.jsonl").read_text().splitlines()]
    right = next(row["a"] for row in qa if row["q"] == prompt)
    already = len(sent)
    rewards = remote_reward(client)(
        prompts=[prompt] * 4,
        completions=[right, "wrong", "wrong", right],
        sample_id=[sid] * 4,
        slot=[first, first, second, second],
        completion_index=[0, 1, 0, 1],
        iteration=[10] * 4,
    )
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    items = [i for r in sent[already:] if r.url.path == "/grade" for i in json.loads(r.content)["items"]]
    assert [(i["slot"], i["completion_index"]) for i in items] == [(first, 0), (first, 1), (second, 0), (second, 1)]


@pytest.mark.parametrize(("on_error", "expected"), [("skip", [None, 1.0]), ("server", [-1.0, 1.0])])
def test_a_grading_error_is_never_an_invented_reward(
    on_error: Any, expected: list[float | None], with_meta: WithMeta
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "results": [
                    {"sample_id": "s:0123456789:1", "slot": 0, "completion_index": 0, "reward": -1.0, "error": "boom"},
                    {"sample_id": "s:0123456789:1", "slot": 0, "completion_index": 1, "reward": 1.0},
                ]
            },
        )

    client = ProctorClient("http://proctor.test", transport=with_meta(handler))
    metrics: list[tuple[str, float]] = []
    rewards = remote_reward(client, on_error=on_error)(
        prompts=["p"] * 2,
        completions=["a", "b"],
        sample_id=["s:0123456789:1"] * 2,
        slot=[0, 0],
        completion_index=[0, 1],
        iteration=[0, 0],
        log_metric=lambda n, v: metrics.append((n, v)),
    )
    assert rewards == expected
    assert ("proctor/grading_errors", 1.0) in metrics


class StepKeys(TypedDict):
    """The columns a reward function gets from the dataset's rows, naming each completion's row of the step."""

    sample_id: list[str]
    slot: list[int]
    completion_index: list[int]
    iteration: list[int]


class Columns(StepKeys):
    """The columns of a generation batch, as TRL passes them to a reward function."""

    prompts: list[str]
    completions: list[str]


def step_keys(rows: Sequence[Mapping[str, Any]]) -> StepKeys:
    """The step keys of a batch of the dataset's rows, one a completion."""
    return StepKeys(
        sample_id=[r["sample_id"] for r in rows],
        slot=[r["slot"] for r in rows],
        completion_index=[r["completion_index"] for r in rows],
        iteration=[r["iteration"] for r in rows],
    )


# The columns of a generation batch of one completion.
ONE_ROW: Columns = {
    "prompts": ["p"],
    "completions": ["a"],
    "sample_id": ["s:0123456789:1"],
    "slot": [0],
    "completion_index": [0],
    "iteration": [0],
}


def test_a_failing_grade_raises_after_the_retries(with_meta: WithMeta) -> None:
    attempts: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        return httpx.Response(503, json={"detail": "state file stopped accepting writes"})

    client = ProctorClient("http://proctor.test", transport=with_meta(handler), retries=2, sleep=lambda s: None)
    with pytest.raises(ServerFailure, match="state file stopped accepting writes"):
        remote_reward(client)(**ONE_ROW)
    assert len(attempts) == 3


def test_a_missing_result_is_an_error_not_a_zero(with_meta: WithMeta) -> None:
    client = ProctorClient(
        "http://proctor.test", transport=with_meta(lambda r: httpx.Response(200, json={"results": []}))
    )
    with pytest.raises(RuntimeError, match=r"/grade returned no result for slot 0 \('s:0123456789:1'\), completion 0"):
        remote_reward(client)(**ONE_ROW)


def test_needs_the_dataset_columns() -> None:
    client = ProctorClient("http://proctor.test", transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    with pytest.raises(TypeError, match=r"train on a proctor\.client\.RemoteRLDataset"):
        remote_reward(client)(prompts=["p"], completions=["a"])
    with pytest.raises(ValueError, match="on_error must be 'skip' or 'server'"):
        remote_reward(client, on_error="zero")  # type: ignore[call-overload]
    with pytest.raises(
        ValueError, match=r"^remote_reward\(through='store'\) needs dataset=, the run's RemoteRLDataset"
    ):
        remote_reward(client, through="store")
    with pytest.raises(ValueError, match="through must be 'store' or 'grade', got 'post'"):
        remote_reward(client, through="post")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        remote_reward(client, timeout_s=0)


def test_with_the_dataset_the_next_prompts_are_fetched_while_grading(client: ProctorClient) -> None:
    ds = dataset(client)
    reward = remote_reward(client, dataset=ds)
    assert ds.fetcher.prefetch is False  # no prefetch during generation any more: it moved next to /grade
    rows = ds.__getitems__([0, 0, 1, 1])
    assert ds.requested == [0]
    reward(
        prompts=[r["prompt"] for r in rows],
        completions=["1", "2", "3", "4"],
        **step_keys(rows),
    )
    ds.fetcher._pool.submit(lambda: None).result()  # the prefetch thread has run what was queued
    assert ds.requested == [0, 1, 2]
    ds.close()


def test_a_step_generated_again_after_a_resume_is_graded_beside_the_first_attempt(client: ProctorClient) -> None:
    from proctor.client import ExperienceClient

    ds = dataset(client)
    rows = ds.__getitems__([0, 0, 1, 1])
    keys = step_keys(rows)
    answers = [str(eval(r["metadata"]["expression"])) for r in rows]
    # The first attempt, then the step generated again with other completions by a resumed run (a new
    # reward function, as in a new process): both are graded, neither refuses the other.
    first = remote_reward(client, dataset=ds)(prompts=["p"] * 4, completions=["no"] * 4, **keys)
    second = remote_reward(client, dataset=ds)(prompts=["p"] * 4, completions=answers, **keys)
    ds.close()
    assert (first, second) == ([0.0] * 4, [1.0] * 4)
    with ExperienceClient(client=client) as experience:
        step_rows = [(int(s), int(k)) for s, k in zip(keys["slot"], keys["completion_index"], strict=True)]
        assert experience.read(0, step_rows, ["completion"])["completion"] == ["no"] * 4
        loose = experience.table(-1)
        assert loose.written["completion"] == 4
        loose_rows = [(s, k) for s in range(loose.slots) for k in range(2)]
        assert sorted(experience.read(-1, loose_rows, ["step_slot"])["step_slot"]) == [0, 0, 1, 1]


def test_a_step_whose_table_the_store_no_longer_keeps_is_graded_through_grade(
    live_server: Callable[..., AbstractContextManager[str]],
) -> None:
    with live_server(experience_keep_iterations=1) as url, ProctorClient(url) as client:
        ds = dataset(client)
        rows = ds.__getitems__([0, 0, 1, 1])
        client.sample(1, 2)  # the store keeps one step: step 1's table drops step 0's
        answers = [str(eval(r["metadata"]["expression"])) for r in rows]
        keys = step_keys(rows)
        rewards = remote_reward(client, dataset=ds)(prompts=["p"] * 4, completions=answers, **keys)
        ds.close()
    assert rewards == [1.0] * 4


def test_components_are_a_reward_function_per_grader_fed_by_one_grade_call(
    client: ProctorClient, curriculum_file: Path, sent: list[httpx.Request]
) -> None:
    # Iteration 10 is in stage `main`: `add` (graded by `numeric`) and `qa` (by `exact_match`, and `half` with
    # weight 0). The tiny curriculum's other sources bring `slow`, `boom` and `crash`, and `faulty` weighs
    # `numeric` half where `add` weighs it whole.
    funcs = remote_reward(client, components=True)
    assert [f.__name__ for f in funcs] == ["numeric", "exact_match", "half", "slow", "boom", "crash"]
    weights = {f.__name__: f.weight for f in funcs}
    assert weights == {"numeric": None, "exact_match": 1.0, "half": 0.0, "slow": 1.0, "boom": 0.5, "crash": 1.0}
    samples = client.sample(10, 4).samples
    qa = {row["q"]: row["a"] for row in map(json.loads, (curriculum_file.parent / "qa.jsonl").read_text().splitlines())}
    completions = [qa.get(s.prompt, str(eval(s.metadata.get("expression", "0")))) for s in samples]
    cols: dict[str, Any] = {
        "prompts": [s.prompt for s in samples],
        "completions": completions,
        "sample_id": [s.sample_id for s in samples],
        "slot": [s.slot for s in samples],
        "completion_index": [0] * len(samples),
        "iteration": [10] * len(samples),
    }
    already = len(sent)
    scores = {f.__name__: f(**cols) for f in funcs}
    # One /grade for all of them.
    assert sum(r.url.path == "/grade" for r in sent[already:]) == 1
    is_qa = [s.dataset_id == "qa" for s in samples]
    assert scores["exact_match"] == [1.0 if q else None for q in is_qa]
    assert scores["half"] == [0.5 if q else None for q in is_qa]
    assert scores["numeric"] == [None if q else 1.0 for q in is_qa]
    assert scores["slow"] == scores["boom"] == scores["crash"] == [None] * len(samples)
    # The same rows again (the next step's call would differ): still no second /grade.
    assert remote_reward(client)(**cols) == [1.0] * len(samples)
    assert funcs[0](**cols) == scores["numeric"]
    assert sum(r.url.path == "/grade" for r in sent[already:]) == 2  # the second from the plain reward above


def test_components_need_on_error_skip(with_meta: WithMeta) -> None:
    client = ProctorClient("http://proctor.test", transport=with_meta(lambda r: httpx.Response(500)))
    with pytest.raises(ValueError, match=r"remote_reward\(components=True\) gives each grader's own score"):
        remote_reward(client, on_error="server", components=True)
