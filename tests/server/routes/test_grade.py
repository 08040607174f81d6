"""POST /grade through the ASGI transport: matching, idempotency, graders that fail, bad input."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.anyio

QA_ANSWERS = {"Capital of France?": "Paris", "Colour of the sky?": "blue", "2 + 2?": "4"}


async def sample(client: httpx.AsyncClient, iteration: int, batch_size: int = 4) -> list[dict[str, Any]]:
    response = await client.post("/sample", json={"iteration": iteration, "batch_size": batch_size})
    assert response.status_code == 200, response.text
    samples: list[dict[str, Any]] = response.json()["samples"]
    return samples


def answer(s: dict[str, Any]) -> str:
    """The right answer for a sample of the tiny curriculum (arithmetic expression or QA row)."""
    if s["dataset_id"] == "add":
        return str(eval(s["metadata"]["expression"]))
    return {
        "Capital of France?": "Paris",
        "Colour of the sky?": "blue",
        "2 + 2?": "4",
        "Opposite of hot?": "cold",
        "Largest planet?": "Jupiter",
        "Frozen water?": "ice",
    }[s["prompt"]]


async def grade(client: httpx.AsyncClient, items: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    response = await client.post("/grade", json={"items": items, **extra})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


async def sample_id_of(client: httpx.AsyncClient, source: str, key: int = 0) -> str:
    """A valid id of a source no stage serves (graded directly, as an evaluation client would)."""
    meta = (await client.get("/meta")).json()
    version = next(s["version"] for s in meta["sources"] if s["name"] == source)
    return f"{source}:{version}:{key}"


async def test_results_are_matched_by_id_and_index_not_position(client: httpx.AsyncClient) -> None:
    samples = await sample(client, 0)
    items = []
    for s in samples:
        items.append({"sample_id": s["sample_id"], "completion": answer(s), "completion_index": 0})
        items.append({"sample_id": s["sample_id"], "completion": "no idea", "completion_index": 1})
    random.Random(0).shuffle(items)
    results = await grade(client, items, iteration=0)
    assert len(results) == len(items)
    for item, result in zip(items, results, strict=True):
        assert (result["sample_id"], result["completion_index"]) == (item["sample_id"], item["completion_index"])
        assert result["reward"] == (1.0 if item["completion_index"] == 0 else 0.0)
        assert result["components"] == {"numeric": result["reward"]}
        assert result["error"] is None


async def test_missing_completion_index_numbers_each_prompts_items_in_order(client: httpx.AsyncClient) -> None:
    [s, *_] = await sample(client, 0)
    results = await grade(client, [{"sample_id": s["sample_id"], "completion": c} for c in ("a", "b", "c")])
    assert [r["completion_index"] for r in results] == [0, 1, 2]


async def test_regrading_returns_the_stored_result_and_counts_once(client: httpx.AsyncClient) -> None:
    samples = await sample(client, 0)
    items = [{"sample_id": s["sample_id"], "completion": answer(s), "completion_index": 0} for s in samples]
    first = await grade(client, items, iteration=0)
    second = await grade(client, items, iteration=0)
    assert [r["cached"] for r in first] == [False] * 4
    assert [r["cached"] for r in second] == [True] * 4
    assert [r["reward"] for r in first] == [r["reward"] for r in second]
    warm = (await client.get("/curriculum")).json()["stages"][0]
    assert warm["graded"] == 4
    assert warm["rolling_count"] == 4


async def test_same_index_with_another_completion_is_a_new_grade(client: httpx.AsyncClient) -> None:
    [s, *_] = await sample(client, 0)
    right = await grade(client, [{"sample_id": s["sample_id"], "completion": answer(s)}], iteration=0)
    wrong = await grade(client, [{"sample_id": s["sample_id"], "completion": "nope"}], iteration=0)
    assert (right[0]["reward"], wrong[0]["reward"]) == (1.0, 0.0)
    assert not wrong[0]["cached"]


async def test_weights_and_components(client: httpx.AsyncClient) -> None:
    # qa's graders: exact_match (weight 1) + half (weight 0, a metric only): reward is exact_match alone.
    sid = await sample_id_of(client, "qa", 0)
    [result] = await grade(client, [{"sample_id": sid, "completion": "Paris"}])
    assert result["reward"] == 1.0
    assert result["components"] == {"exact_match": 1.0, "half": 0.5}


async def test_a_raising_grader_gives_an_error_result_with_on_error(client: httpx.AsyncClient) -> None:
    sid = await sample_id_of(client, "faulty")
    [result] = await grade(client, [{"sample_id": sid, "completion": "3"}])
    assert result["reward"] == -1.0
    assert "boom: RuntimeError: boom: this grader fails on purpose" in result["error"]
    metrics = (await client.get("/metrics")).text
    assert 'proctor_grader_errors_total{grader="boom",kind="error"} 1.0' in metrics


async def test_a_grader_timeout_is_an_error_result_and_the_server_carries_on(
    open_client: Callable[..., Any],
) -> None:
    async with open_client(grader_timeout_s=0.5) as c:
        sid = await sample_id_of(c, "slowpoke")
        [result] = await grade(c, [{"sample_id": sid, "completion": "1"}])
        assert result["reward"] == -0.5
        assert result["error"] == "slow: graders did not finish within 0.5s"
        # The pool replaced the stuck worker: ordinary grading still works.
        [s, *_] = await sample(c, 0)
        [ok] = await grade(c, [{"sample_id": s["sample_id"], "completion": answer(s)}])
        assert ok["reward"] == 1.0
        metrics = (await c.get("/metrics")).text
        assert 'proctor_grader_errors_total{grader="slow",kind="timeout"} 1.0' in metrics


async def test_a_crashing_grader_process_is_an_error_result(client: httpx.AsyncClient) -> None:
    sid = await sample_id_of(client, "crashy")
    [result] = await grade(client, [{"sample_id": sid, "completion": "1"}])
    assert result["error"] == "crash: the grader process died (exit code 7)"
    assert result["reward"] == 0.0


async def test_errors_are_retried_not_cached(client: httpx.AsyncClient) -> None:
    sid = await sample_id_of(client, "faulty")
    first = await grade(client, [{"sample_id": sid, "completion": "3"}])
    again = await grade(client, [{"sample_id": sid, "completion": "3"}])
    assert first[0]["error"] and again[0]["error"]
    assert not again[0]["cached"]


async def test_a_stale_sample_id_is_an_error_result_not_a_grade(client: httpx.AsyncClient) -> None:
    [s, *_] = await sample(client, 0)
    source, version, key = s["sample_id"].split(":")
    stale = f"{source}:{'0' * 10}:{key}"
    [result] = await grade(client, [{"sample_id": stale, "completion": answer(s)}])
    assert result["reward"] == 0.0
    assert result["error"].startswith("stale sample_id: it was served from version 0000000000 of source 'add'")
    assert f"which is now version {version}" in result["error"]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"sample_id": "nonsense", "completion": "x"}], "items[0].sample_id: malformed sample_id 'nonsense'"),
        ([{"sample_id": "gsm9k:0123456789:1", "completion": "x"}], "items[0].sample_id: unknown source 'gsm9k'"),
        ([{"sample_id": "", "completion": "x"}], "items[0].sample_id: malformed sample_id ''"),
        ([{"sample_id": "add:0123456789:1\n", "completion": "x"}], "items[0].sample_id: malformed sample_id"),
        ([{"sample_id": "add:0123456789:1"}], "items[0].completion: Field required"),
        ([{"sample_id": "add:0123456789:1", "completion": 5}], "items[0].completion: Input should be a valid string"),
        (
            [{"sample_id": "add:0123456789:1", "completion": "x", "completion_tokens": -1}],
            "items[0].completion_tokens: Input should be greater than or equal to 0",
        ),
        (
            [{"sample_id": "add:0123456789:1", "completion": "x", "completion_idx": 1}],
            "items[0]: unknown field 'completion_idx'; the fields are sample_id, completion, completion_tokens, "
            "completion_index, slot",
        ),
    ],
    ids=[
        "malformed-id",
        "unknown-source",
        "empty-id",
        "trailing-newline",
        "no-completion",
        "completion-not-string",
        "negative-tokens",
        "unknown-field",
    ],
)
async def test_bad_items(client: httpx.AsyncClient, items: list[dict[str, Any]], message: str) -> None:
    response = await client.post("/grade", json={"items": items})
    assert response.status_code == 422
    assert message in response.json()["detail"]


async def test_unknown_fields_are_named_with_the_known_ones_wherever_they_are(client: httpx.AsyncClient) -> None:
    item = {"sample_id": "add:0123456789:1", "completion": "x"}
    response = await client.post("/grade", json={"items": [item, {**item, "a": 1, "b": 2, "c": 3, "d": 4}], "x": 0})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "items[1]: unknown fields 'a', 'b', 'c', …; the fields are sample_id, completion, completion_tokens, "
        "completion_index, slot; body: unknown field 'x'; the fields are iteration, items"
    )
    # The experience store's requests too.
    response = await client.post("/experience/tables/0/rows", json={"rows": [], "colums": {}})
    assert response.status_code == 422
    assert response.json()["detail"] == "body: unknown field 'colums'; the fields are rows, columns, read, wait_s"


async def test_record_out_of_range_is_422(client: httpx.AsyncClient) -> None:
    sid = await sample_id_of(client, "qa", 99)
    response = await client.post("/grade", json={"items": [{"sample_id": sid, "completion": "x"}]})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "items[0].sample_id: source 'qa' has no record 99 (it has 6); send sample ids exactly as /sample returned them"
    )


async def test_duplicate_pair_in_one_request_is_422(client: httpx.AsyncClient) -> None:
    [s, *_] = await sample(client, 0)
    items = [{"sample_id": s["sample_id"], "completion": c, "completion_index": 2} for c in ("a", "b")]
    response = await client.post("/grade", json={"items": items})
    assert response.status_code == 422
    assert "items[1]: (sample_id, completion_index)" in response.json()["detail"]
    assert "already appears at items[0]" in response.json()["detail"]


async def test_completion_over_the_limit_is_422(open_client: Callable[..., Any]) -> None:
    async with open_client(max_completion_chars=10) as c:
        [s, *_] = await sample(c, 0)
        response = await c.post("/grade", json={"items": [{"sample_id": s["sample_id"], "completion": "x" * 11}]})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "items[0].completion: 11 characters is above this server's maximum of 10 (PROCTOR_MAX_COMPLETION_CHARS)"
    )


async def test_too_many_items_is_422(open_client: Callable[..., Any]) -> None:
    async with open_client(max_grade_items=2) as c:
        items = [{"sample_id": "add:0123456789:1", "completion": "1"}] * 3
        response = await c.post("/grade", json={"items": items})
    assert response.status_code == 422
    assert response.json()["detail"].startswith("items: 3 items is above this server's maximum of 2 per request")


async def test_body_over_the_limit_is_413(open_client: Callable[..., Any]) -> None:
    async with open_client(max_body_bytes=2048) as c:
        body = {"items": [{"sample_id": "add:0123456789:1", "completion": "x" * 4096}]}
        response = await c.post("/grade", json=body)
    assert response.status_code == 413
    assert "PROCTOR_MAX_BODY_BYTES" in response.json()["detail"]


async def test_body_over_the_limit_without_content_length_is_413(open_client: Callable[..., Any]) -> None:
    async def chunks() -> Any:
        for _ in range(8):
            yield b" " * 1024

    async with open_client(max_body_bytes=2048) as c:
        response = await c.post("/grade", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


async def test_grades_attributed_without_iteration_use_the_serving_iteration(client: httpx.AsyncClient) -> None:
    # Sample into stage "main" (iteration 10+), grade without `iteration`: the grade counts for "main".
    samples = await sample(client, 12)
    await grade(client, [{"sample_id": s["sample_id"], "completion": answer(s)} for s in samples])
    stages = {st["name"]: st for st in (await client.get("/curriculum")).json()["stages"]}
    assert stages["main"]["graded"] == 4
    assert stages["warm"]["graded"] == 0


async def test_the_gate_advances_the_stage_once_rewards_are_good(client: httpx.AsyncClient) -> None:
    # warm: advance at mean ≥ 0.9 over 4 graded completions, after ≥ 2 iterations.
    for iteration in (0, 1):
        samples = await sample(client, iteration)
        await grade(
            client, [{"sample_id": s["sample_id"], "completion": answer(s)} for s in samples], iteration=iteration
        )
        assert (await client.post("/sample", json={"iteration": iteration, "batch_size": 4})).json()["stage"] == "warm"
    nxt = await client.post("/sample", json={"iteration": 2, "batch_size": 4})
    assert nxt.json()["stage"] == "main"
    state = (await client.get("/curriculum")).json()
    [transition] = state["transitions"]
    assert transition["iteration"] == 2
    assert (transition["from_stage"], transition["to_stage"]) == ("warm", "main")
    assert transition["reason"].startswith("gate: mean reward 1.000 ≥ 0.9 over the last 4 graded completions")
    assert state["current_stage"] == "main"
    # Earlier iterations keep the stage they were served in.
    assert (await client.post("/sample", json={"iteration": 1, "batch_size": 4})).json()["stage"] == "warm"


async def test_the_gate_holds_while_rewards_are_poor(client: httpx.AsyncClient) -> None:
    for iteration in range(4):
        samples = await sample(client, iteration)
        await grade(
            client, [{"sample_id": s["sample_id"], "completion": "wrong"} for s in samples], iteration=iteration
        )
    assert (await client.post("/sample", json={"iteration": 4, "batch_size": 4})).json()["stage"] == "warm"
    assert (await client.get("/curriculum")).json()["transitions"] == []


async def test_a_record_served_in_two_slots_is_graded_as_two_prompts(client: httpx.AsyncClient) -> None:
    # Iteration 10 is in stage `main`: 12 of 16 prompts from the 6-row `qa` source, so records must repeat.
    samples = await sample(client, 10, batch_size=16)
    slots: dict[str, list[int]] = {}
    for s in samples:
        slots.setdefault(s["sample_id"], []).append(s["slot"])
    assert [s["slot"] for s in samples] == list(range(16))
    sid, (first, second, *_) = next((k, v) for k, v in slots.items() if len(v) > 1)
    right = answer(next(s for s in samples if s["sample_id"] == sid))
    items = [
        {"sample_id": sid, "slot": first, "completion": right, "completion_index": 0},
        {"sample_id": sid, "slot": second, "completion": "wrong", "completion_index": 0},
    ]
    results = await grade(client, items, iteration=10)
    assert [(r["slot"], r["completion_index"], r["reward"]) for r in results] == [(first, 0, 1.0), (second, 0, 0.0)]
    again = await grade(client, items, iteration=10)
    assert [r["cached"] for r in again] == [True, True]
    assert [r["reward"] for r in again] == [1.0, 0.0]


async def test_a_record_in_two_slots_without_its_slot_is_422_naming_slot(client: httpx.AsyncClient) -> None:
    samples = await sample(client, 10, batch_size=16)
    slots: dict[str, list[int]] = {}
    for s in samples:
        slots.setdefault(s["sample_id"], []).append(s["slot"])
    sid, held = next((k, v) for k, v in slots.items() if len(v) > 1)
    response = await client.post("/grade", json={"iteration": 10, "items": [{"sample_id": sid, "completion": "x"}]})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        f"items[0].slot: {sid!r} fills slots {', '.join(map(str, held))} of iteration 10, each a prompt of its own: "
        "send each item's slot as /sample returned it"
    )


async def test_without_a_slot_an_item_gets_the_one_its_record_fills(client: httpx.AsyncClient) -> None:
    samples = await sample(client, 0)
    items = [{"sample_id": s["sample_id"], "completion": answer(s)} for s in reversed(samples)]
    results = await grade(client, items, iteration=0)
    assert [r["slot"] for r in results] == [3, 2, 1, 0]
    assert [r["reward"] for r in results] == [1.0] * 4
    # The same completions with their slots sent are the same grades.
    with_slots = await grade(client, [{**it, "slot": 3 - n} for n, it in enumerate(items)], iteration=0)
    assert [r["cached"] for r in with_slots] == [True] * 4
    # A record that is not in the iteration's batch keeps no slot: graded by its sample_id.
    stray = await sample_id_of(client, "add", 10**6)
    [outside] = await grade(client, [{"sample_id": stray, "completion": "1"}], iteration=0)
    assert outside["slot"] is None


@pytest.mark.parametrize(
    ("item", "extra", "message"),
    [
        ({"slot": 99}, {"iteration": 0}, "items[0].slot: iteration 0 has 4 slots (0..3), not 99"),
        ({"slot": 1}, {"iteration": 0}, "items[0].slot: slot 1 of iteration 0 holds"),
        ({"slot": 0}, {}, "items[0].slot is a position in one iteration's batch: send the request's iteration too"),
        ({"slot": 0}, {"iteration": 500}, "iteration: iteration 500 was never sampled by this server"),
        ({"slot": -1}, {"iteration": 0}, "items[0].slot: Input should be greater than or equal to 0; got -1"),
        ({"slot": "0"}, {"iteration": 0}, 'items[0].slot: Input should be a JSON integer; got "0"'),
    ],
    ids=["out-of-range", "another-record", "no-iteration", "iteration-never-sampled", "negative", "string"],
)
async def test_bad_slots(client: httpx.AsyncClient, item: dict[str, Any], extra: dict[str, Any], message: str) -> None:
    [s, *_] = await sample(client, 0)
    assert s["slot"] == 0
    body = {"items": [{"sample_id": s["sample_id"], "completion": "1", **item}], **extra}
    response = await client.post("/grade", json=body)
    assert response.status_code == 422
    assert message in response.json()["detail"]


async def test_the_same_slot_and_index_twice_is_422(client: httpx.AsyncClient) -> None:
    [s, *_] = await sample(client, 0)
    item = {"sample_id": s["sample_id"], "slot": 0, "completion_index": 0}
    response = await client.post(
        "/grade", json={"iteration": 0, "items": [{**item, "completion": "1"}, {**item, "completion": "2"}]}
    )
    assert response.status_code == 422
    assert response.json()["detail"].startswith(
        "items[1]: (slot, completion_index) = (0, 0) already appears at items[0]"
    )
