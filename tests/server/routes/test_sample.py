"""POST /sample through the ASGI transport."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(open_client: Callable[..., Any]) -> AsyncIterator[httpx.AsyncClient]:
    # These tests only sample: the server needs no grader process.
    async with open_client(grader_workers=0) as c:
        yield c


async def sample(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/sample", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def test_kolibrify_shape(client: httpx.AsyncClient) -> None:
    data = await sample(client, iteration=0, batch_size=4)
    assert data["iteration"] == 0
    assert data["stage"] == "warm"
    assert len(data["samples"]) == 4
    for s in data["samples"]:
        assert set(s) >= {"sample_id", "dataset_id", "system_prompt", "prompt", "metadata"}
        assert s["dataset_id"] == "add"
        assert s["sample_id"].startswith("add:")
        assert s["system_prompt"] == "Answer briefly."


async def test_repeat_returns_identical_batch(client: httpx.AsyncClient) -> None:
    first = await sample(client, iteration=3, batch_size=8)
    again = await sample(client, iteration=3, batch_size=8)
    assert again["samples"] == first["samples"]


async def test_rank_shares_are_contiguous_slices_of_one_batch(client: httpx.AsyncClient) -> None:
    # Rank 1 asks first: the batch is fixed by whoever comes first, shares are slices of it.
    shares = [await sample(client, iteration=12, batch_size=8, rank=r, world_size=4) for r in (1, 0, 3, 2)]
    by_rank = {s["rank"]: s["samples"] for s in shares}
    whole = await sample(client, iteration=12, batch_size=8)
    assert [x for r in range(4) for x in by_rank[r]] == whole["samples"]
    assert all(len(by_rank[r]) == 2 for r in range(4))


async def test_quotas_are_exact_in_a_mixed_stage(client: httpx.AsyncClient) -> None:
    # Stage "main" (iterations 10..19) mixes add 0.25 / qa 0.75: a batch of 4 is exactly 1 and 3.
    for iteration in range(10, 16):
        data = await sample(client, iteration=iteration, batch_size=4)
        assert data["stage"] == "main"
        assert Counter(s["dataset_id"] for s in data["samples"]) == {"add": 1, "qa": 3}


async def test_same_requests_on_two_servers_give_the_same_batches(open_client: Callable[..., Any]) -> None:
    batches = []
    for _ in range(2):
        async with open_client() as c:
            batches.append([await sample(c, iteration=i, batch_size=6) for i in (0, 1, 2, 15, 25)])
    assert batches[0] == batches[1]


async def test_skipping_iterations_gives_the_batch_a_full_walk_gives(open_client: Callable[..., Any]) -> None:
    async with open_client() as walked:
        for i in range(24):
            last = await sample(walked, iteration=i, batch_size=4)
    async with open_client() as jumped:
        direct = await sample(jumped, iteration=23, batch_size=4)
    assert direct["samples"] == last["samples"]
    assert direct["stage"] == last["stage"] == "final"


async def test_other_batch_size_for_a_sampled_iteration_is_409(client: httpx.AsyncClient) -> None:
    await sample(client, iteration=2, batch_size=8)
    response = await client.post("/sample", json={"iteration": 2, "batch_size": 16})
    assert response.status_code == 409
    assert "iteration 2 was sampled with batch_size 8" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"iteration": -1, "batch_size": 4}, 422, "iteration: Input should be greater than or equal to 0"),
        ({"iteration": 0, "batch_size": 0}, 422, "batch_size: Input should be greater than 0"),
        ({"iteration": 0, "batch_size": -3}, 422, "batch_size: Input should be greater than 0"),
        ({"iteration": 0, "batch_size": 4097}, 422, "batch_size: 4097 is above this server's maximum of 4096"),
        ({"iteration": 0, "batch_size": 100_000_000}, 422, "PROCTOR_MAX_BATCH_SIZE"),
        ({"iteration": "zero", "batch_size": 4}, 422, 'iteration: Input should be a JSON integer; got "zero"'),
        ({"iteration": 1.5, "batch_size": 4}, 422, "iteration: Input should be a JSON integer; got 1.5"),
        ({"batch_size": 4}, 422, "iteration: Field required"),
        ({"iteration": 0, "batch_size": 4, "rank": 0}, 422, "rank and world_size go together"),
        ({"iteration": 0, "batch_size": 4, "rank": 4, "world_size": 4}, 422, "rank 4 must be below world_size 4"),
        (
            {"iteration": 0, "batch_size": 6, "rank": 0, "world_size": 4},
            422,
            "cannot be split evenly over world_size 4",
        ),
        (
            {"iteration": 0, "batch_size": 4, "world_size": 0, "rank": 0},
            422,
            "world_size: Input should be greater than 0",
        ),
    ],
    ids=[
        "negative-iteration",
        "zero-batch",
        "negative-batch",
        "batch-over-max",
        "huge-batch",
        "iteration-string",
        "iteration-float",
        "missing-iteration",
        "rank-alone",
        "rank-out-of-range",
        "uneven-split",
        "zero-world",
    ],
)
async def test_bad_sample_requests(client: httpx.AsyncClient, body: dict[str, Any], status: int, message: str) -> None:
    response = await client.post("/sample", json=body)
    assert response.status_code == status
    assert message in response.json()["detail"]


async def test_an_unknown_field_is_refused_naming_the_known_ones(client: httpx.AsyncClient) -> None:
    response = await client.post("/sample", json={"iteration": 0, "batch_size": 4, "bacth": 1})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "body: unknown field 'bacth'; the fields are iteration, batch_size, rank, world_size"
    )
    assert (await client.get("/curriculum")).json()["last_iteration"] is None


async def test_a_stray_iteration_does_not_become_the_latest(client: httpx.AsyncClient) -> None:
    response = await client.post("/sample", json={"iteration": 2**53 - 1, "batch_size": 4})
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "iteration: 9007199254740991 is more than 100000 iterations past the run's latest (none was sampled yet); "
        "ask for the generation steps in order, or raise PROCTOR_MAX_ITERATION_LEAP"
    )
    assert (await client.get("/healthz")).json()["last_iteration"] is None


async def test_the_leap_counts_from_the_latest_sampled_iteration(open_client: Callable[..., Any]) -> None:
    async with open_client(max_iteration_leap=10) as c:
        await sample(c, iteration=9, batch_size=4)  # the first: 9 is within 10 of nothing sampled
        await sample(c, iteration=19, batch_size=4)
        response = await c.post("/sample", json={"iteration": 30, "batch_size": 4})
        assert response.status_code == 422
        assert (
            "30 is more than 10 iterations past the run's latest (the latest sampled is 19)"
            in response.json()["detail"]
        )
        # Iterations already served stay served, whatever the leap.
        assert (await sample(c, iteration=9, batch_size=4))["iteration"] == 9


async def test_huge_batch_is_refused_without_work(client: httpx.AsyncClient) -> None:
    # kolibrify spends 20 s and 3.5 GB on this; here it must not even start building a batch.
    started = time.perf_counter()
    response = await client.post("/sample", json={"iteration": 0, "batch_size": 100_000_000})
    assert response.status_code == 422
    assert time.perf_counter() - started < 10  # a liveness bound: building that batch would take minutes
    assert (await client.get("/curriculum")).json()["last_iteration"] is None


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/sample", content=b'{"iteration": 0,', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("body: malformed JSON")


async def test_configured_maximum_applies(open_client: Callable[..., Any]) -> None:
    async with open_client(max_batch_size=8) as c:
        response = await c.post("/sample", json={"iteration": 0, "batch_size": 9})
    assert response.status_code == 422
    assert response.json()["detail"] == ("batch_size: 9 is above this server's maximum of 8 (PROCTOR_MAX_BATCH_SIZE)")


async def test_full_sync_writes_through_the_store_thread(open_client: Callable[..., Any], tmp_path: Any) -> None:
    async with open_client(database_url=str(tmp_path / "s.db"), state_sync="full") as c:
        first = await sample(c, iteration=0, batch_size=4)
        assert (await sample(c, iteration=0, batch_size=4)) == first
        items = [{"sample_id": s["sample_id"], "completion": "1"} for s in first["samples"]]
        assert (await c.post("/grade", json={"iteration": 0, "items": items})).status_code == 200
    async with open_client(database_url=str(tmp_path / "s.db")) as c:
        assert (await sample(c, iteration=0, batch_size=4)) == first
        assert (await c.get("/curriculum")).json()["stages"][0]["graded"] == 4


@pytest.mark.parametrize("budget", [0, 3000, 10**9], ids=["nothing-cached", "a-batch-or-so", "all-cached"])
async def test_repeats_are_the_same_whatever_the_cache_holds(
    open_client: Callable[..., Any], tmp_path: Path, budget: int
) -> None:
    async with open_client(database_url=str(tmp_path / "s.db"), sample_cache_bytes=budget) as client:
        first = [(await client.post("/sample", json={"iteration": i, "batch_size": 8})).json() for i in range(6)]
        again = [(await client.post("/sample", json={"iteration": i, "batch_size": 8})).json() for i in range(6)]
    assert again == first
