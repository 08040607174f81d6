"""POST /refill through the ASGI transport: decided from the stored grades, once, and the same after a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import QA_ROWS, TINY, write_curriculum

pytestmark = pytest.mark.anyio

ANSWERS = {row["q"]: row["a"] for row in QA_ROWS}
G = 2  # completions per prompt


@pytest.fixture
def curriculum_file(tmp_path: Path) -> Path:
    doc = {
        **TINY,
        "stages": [
            {"name": "plain", "until_step": 1, "mix": [{"source": "qa"}]},
            {
                "name": "refilled",
                "until_step": 10,
                "mix": [{"source": "qa"}],
                "refill": {"kind": "zero_variance", "max_rounds": 2},
            },
        ],
    }
    return write_curriculum(tmp_path / "curriculum", doc)


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    data: dict[str, Any] = response.json()
    return data


async def grade(client: httpx.AsyncClient, iteration: int, sample: dict[str, Any], right: list[bool]) -> None:
    """Grade completions of one prompt: right ones answer it, wrong ones do not (exact_match: 1.0 or 0.0)."""
    answer = ANSWERS[sample["prompt"]]
    items = [
        {
            "sample_id": sample["sample_id"],
            "slot": sample["slot"],
            "completion_index": j,
            "completion": answer if ok else "no idea",
        }
        for j, ok in enumerate(right)
    ]
    results = (await post(client, "/grade", {"iteration": iteration, "items": items}))["results"]
    assert [r["components"]["exact_match"] for r in results] == [float(ok) for ok in right]


async def refill(client: httpx.AsyncClient, round_: int, status: int = 200) -> dict[str, Any]:
    return await post(client, "/refill", {"iteration": 1, "round": round_, "group_size": G}, status)


async def test_a_round_replaces_the_groups_without_signal_once(open_client: Callable[..., Any], tmp_path: Path) -> None:
    state = str(tmp_path / "state.db")
    async with open_client(database_url=state) as client:
        batch = await post(client, "/sample", {"iteration": 1, "batch_size": 4})
        assert batch["refill_rounds"] == 2
        stages = (await client.get("/curriculum")).json()["stages"]
        assert [s["refill"] for s in stages] == [None, {"kind": "zero_variance", "max_rounds": 2}]
        samples = batch["samples"]

        never = await refill(client, 1, 422)
        assert never["detail"].startswith("iteration: iteration 1 has no graded completions")

        await grade(client, 1, samples[0], [True, False])
        await grade(client, 1, samples[1], [False, False])
        await grade(client, 1, samples[2], [True, True])
        await grade(client, 1, samples[3], [True])  # one of its two
        partial = await refill(client, 1, 409)
        assert "slot 3 of iteration 1 has 1 of its 2 completions graded" in partial["detail"]
        await grade(client, 1, samples[3], [True, False])

        first = await refill(client, 1)
        assert (first["rule"], first["max_rounds"], first["groups"]) == ("zero_variance", 2, 4)
        assert [r["replaces"] for r in first["replacements"]] == [1, 2]
        new = [r["sample"] for r in first["replacements"]]
        assert [s["slot"] for s in new] == [4, 5]
        # Six records, four in the batch: the replacements are the other two.
        assert {s["prompt"] for s in new} == set(ANSWERS) - {s["prompt"] for s in samples}
        assert await refill(client, 1) == first
        # /sample still serves the step's batch alone.
        assert (await post(client, "/sample", {"iteration": 1, "batch_size": 4}))["samples"] == samples

        early = await refill(client, 2, 409)
        assert "slot 4 of iteration 1 has 0 of its 2 completions graded" in early["detail"]
        for sample in new:
            await grade(client, 1, sample, [True, True])
        second = await refill(client, 2)
        assert second["groups"] == 2
        assert [r["replaces"] for r in second["replacements"]] == [4, 5]
        assert [r["sample"]["slot"] for r in second["replacements"]] == [6, 7]

        # The replaced groups keep their rows in the step's table, marked with the slot that replaced them.
        rows = [(s, k) for s in range(4) for k in range(G)]
        body = {"rows": rows, "columns": ["replaced_by", "reward"], "missing": "none"}
        read = await post(client, "/experience/tables/1/read", body)
        assert read["columns"]["replaced_by"]["values"] == [None] * G + [4] * G + [5] * G + [None] * G
        assert read["columns"]["reward"]["values"] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]

    async with open_client(database_url=state) as client:
        assert await refill(client, 1) == first
        assert await refill(client, 2) == second
        # Round 2's replacements are graded at their slots after the restart too.
        await grade(client, 1, second["replacements"][0]["sample"], [True, False])


async def test_bad_rounds_name_the_field(client: httpx.AsyncClient) -> None:
    await post(client, "/sample", {"iteration": 0, "batch_size": 2})
    await post(client, "/sample", {"iteration": 1, "batch_size": 2})
    plain = await post(client, "/refill", {"iteration": 0, "round": 1, "group_size": G}, 422)
    assert plain["detail"].startswith("round: iteration 0 is in stage 'plain', which replaces no groups")
    beyond = await refill(client, 3, 422)
    assert beyond["detail"] == "round: 3 is beyond the 2 refill rounds stage 'refilled' allows (its refill.max_rounds)"
    skipped = await refill(client, 2, 422)
    assert skipped["detail"].startswith("round: round 2 of iteration 1 comes after round 1, which was never asked")
    unsampled = await post(client, "/refill", {"iteration": 7, "round": 1, "group_size": G}, 422)
    assert unsampled["detail"].startswith("iteration: iteration 7 was never sampled by this server")
    for body, field in [
        ({"iteration": 1, "round": 0, "group_size": G}, "round"),
        ({"iteration": 1, "round": 17, "group_size": G}, "round"),
        ({"iteration": 1, "round": "1", "group_size": G}, "round"),
        ({"iteration": 1, "round": 1, "group_size": 0}, "group_size"),
        ({"iteration": -1, "round": 1, "group_size": G}, "iteration"),
    ]:
        response = await client.post("/refill", json=body)
        assert response.status_code == 422, response.text
        assert field in response.text


async def test_a_retry_with_another_group_size_conflicts(client: httpx.AsyncClient) -> None:
    samples = (await post(client, "/sample", {"iteration": 1, "batch_size": 2}))["samples"]
    for sample in samples:
        await grade(client, 1, sample, [True, False])
    assert (await refill(client, 1))["replacements"] == []
    again = await post(client, "/refill", {"iteration": 1, "round": 1, "group_size": 1}, 409)
    assert again["detail"] == "round 1 of iteration 1 was decided with group_size 2; ask again with that group_size"
