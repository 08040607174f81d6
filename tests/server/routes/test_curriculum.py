"""GET /meta, GET /curriculum and GET /stats/{iteration}."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import QA_ROWS

pytestmark = pytest.mark.anyio


async def test_meta_is_a_kolibrify_superset(client: httpx.AsyncClient) -> None:
    meta = (await client.get("/meta")).json()
    assert meta["total_iterations"] == 30
    assert meta["stages"] == [
        {"name": "warm", "until_step": 10},
        {"name": "main", "until_step": 20},
        {"name": "final", "until_step": 30},
    ]
    assert meta["curriculum"] == "tiny"
    assert meta["seed"] == 5
    assert len(meta["curriculum_hash"]) == 16
    assert meta["max_batch_size"] == 4096
    qa = next(s for s in meta["sources"] if s["name"] == "qa")
    assert (qa["kind"], qa["size"], qa["graders"]) == ("jsonl", 6, ["exact_match", "half"])
    add = next(s for s in meta["sources"] if s["name"] == "add")
    assert (add["kind"], add["size"]) == ("arithmetic", None)


async def test_curriculum_state_before_anything(client: httpx.AsyncClient) -> None:
    state = (await client.get("/curriculum")).json()
    assert state["current_stage"] == "warm"
    assert state["last_iteration"] is None
    assert state["transitions"] == []
    assert [s["started_at"] for s in state["stages"]] == [0, None, None]
    assert state["stages"][0]["advance"] == {"threshold": 0.9, "window": 4, "min_steps": 2}


async def test_until_step_transitions_are_recorded_with_their_iteration(client: httpx.AsyncClient) -> None:
    # Jump straight to iteration 25: both caps (10 and 20) are passed and recorded in order.
    response = await client.post("/sample", json={"iteration": 25, "batch_size": 2})
    assert response.json()["stage"] == "final"
    state = (await client.get("/curriculum")).json()
    assert [(t["iteration"], t["from_stage"], t["to_stage"], t["reason"]) for t in state["transitions"]] == [
        (10, "warm", "main", "reached until_step 10"),
        (20, "main", "final", "reached until_step 20"),
    ]
    assert [s["started_at"] for s in state["stages"]] == [0, 10, 20]
    assert state["stages"][2]["iterations"] == 1
    assert state["stages"][2]["samples"] == 2
    assert state["last_iteration"] == 25


async def test_iterations_past_the_end_stay_in_the_last_stage(client: httpx.AsyncClient) -> None:
    response = await client.post("/sample", json={"iteration": 1000, "batch_size": 2})
    assert response.json()["stage"] == "final"


async def test_stats_give_each_group_of_a_step_and_its_records_state(client: httpx.AsyncClient) -> None:
    samples = (await client.post("/sample", json={"iteration": 25, "batch_size": 2})).json()["samples"]
    answers = {row["q"]: row["a"] for row in QA_ROWS}
    # Slot 0 gets one right and one wrong completion; slot 1 two wrong ones.
    items = [
        {"sample_id": s["sample_id"], "slot": slot, "completion": answers[s["prompt"]] if (slot, k) == (0, 0) else "?"}
        for slot, s in enumerate(samples)
        for k in range(2)
    ]
    assert (await client.post("/grade", json={"iteration": 25, "items": items})).status_code == 200
    stats = (await client.get("/stats/25")).json()
    assert (stats["iteration"], stats["stage"], stats["truncated"]) == (25, "final", False)
    assert stats["groups"] == [
        {"slot": 0, "sample_id": samples[0]["sample_id"], "graded": 2, "mean_reward": 0.5, "reward_std": 0.5},
        {"slot": 1, "sample_id": samples[1]["sample_id"], "graded": 2, "mean_reward": 0.0, "reward_std": 0.0},
    ]
    records = {r["sample_id"]: r for r in stats["records"]}
    first = records[samples[0]["sample_id"]]
    assert (first["passes"], first["fails"], first["groups"], first["last_iteration"]) == (1.0, 1.0, 1, 25)


async def test_stats_of_a_step_never_sampled_are_a_404_and_of_a_bad_one_a_422(client: httpx.AsyncClient) -> None:
    missing = await client.get("/stats/3")
    assert missing.status_code == 404
    assert missing.json()["detail"] == ("iteration 3 was never sampled and has no grades; the latest sampled is none")
    bad = await client.get("/stats/-1")
    assert bad.status_code == 422
    assert bad.json()["detail"] == 'iteration: Input should be greater than or equal to 0; got "-1"'
