"""``--transitions``: a fresh server that adopts another run's stage history serves that run's batches."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.server.services.history import HistoryError

pytestmark = pytest.mark.anyio

LAST = 24


async def batch(client: httpx.AsyncClient, iteration: int) -> list[str]:
    response = await client.post("/sample", json={"iteration": iteration, "batch_size": 4})
    assert response.status_code == 200, response.text
    return [s["sample_id"] for s in response.json()["samples"]]


@dataclass
class OldRun:
    history: Path  # its GET /curriculum answer, saved
    served: dict[int, list[str]]  # the sample ids of each iteration 0..LAST
    state: dict[str, Any]


@pytest.fixture
async def old_run(open_client: Callable[..., Any], tmp_path: Path) -> OldRun:
    """Iterations 0..LAST on a server of its own, with right answers to the first two: stage `warm`'s gate
    fires at iteration 2. Its history is saved as `--transitions` reads it."""
    served: dict[int, list[str]] = {}
    async with open_client(database_url=str(tmp_path / "old.db")) as old:
        for i in range(LAST + 1):
            samples = (await old.post("/sample", json={"iteration": i, "batch_size": 4})).json()["samples"]
            served[i] = [s["sample_id"] for s in samples]
            if i < 2:
                items = [
                    {"sample_id": s["sample_id"], "completion": str(eval(s["metadata"]["expression"]))} for s in samples
                ]
                assert (await old.post("/grade", json={"iteration": i, "items": items})).status_code == 200
        state: dict[str, Any] = (await old.get("/curriculum")).json()
    history = tmp_path / "curriculum.json"
    history.write_text(json.dumps(state))
    return OldRun(history, served, state)


async def test_an_adopted_history_reproduces_every_batch_the_old_run_served(
    open_client: Callable[..., Any], tmp_path: Path, old_run: OldRun
) -> None:
    assert [(t["iteration"], t["reason"].split(":")[0]) for t in old_run.state["transitions"]] == [
        (2, "gate"),
        (20, "reached until_step 20"),
    ]

    order = list(range(LAST + 1))
    random.Random(3).shuffle(order)  # the new server is asked in another order, and sees no grades at all
    async with open_client(database_url=str(tmp_path / "new.db"), transitions=old_run.history) as new:
        assert {i: await batch(new, i) for i in order} == old_run.served
        transitions = (await new.get("/curriculum")).json()["transitions"]
        assert transitions == old_run.state["transitions"]

    # Without the history the gate's decision is lost: the batches differ from iteration 2 on.
    async with open_client(database_url=str(tmp_path / "bare.db")) as bare:
        again = {i: await batch(bare, i) for i in order}
    assert [again[i] == old_run.served[i] for i in range(3)] == [True, True, False]


async def test_a_restart_keeps_the_adopted_history_without_the_flag(
    open_client: Callable[..., Any], tmp_path: Path, old_run: OldRun
) -> None:
    async with open_client(database_url=str(tmp_path / "new.db"), transitions=old_run.history) as new:
        assert await batch(new, 3) == old_run.served[3]
    async with open_client(database_url=str(tmp_path / "new.db")) as restarted:
        assert await batch(restarted, 7) == old_run.served[7]
    # Adopting the same history twice changes nothing.
    async with open_client(database_url=str(tmp_path / "new.db"), transitions=old_run.history) as again:
        assert await batch(again, 9) == old_run.served[9]


async def test_a_history_that_contradicts_the_state_file_is_refused(
    open_client: Callable[..., Any], tmp_path: Path, old_run: OldRun
) -> None:
    async with open_client(database_url=str(tmp_path / "other.db")) as other:
        await batch(other, 5)  # served iteration 5 in stage warm, where the history says main
    with pytest.raises(HistoryError, match=r"already served iterations up to 5, so a transition at 2 would change"):
        async with open_client(database_url=str(tmp_path / "other.db"), transitions=old_run.history):
            pass


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a GET /curriculum answer"),
        ('{"curriculum": "tiny"}', "not a GET /curriculum answer"),
    ],
    ids=["not-json", "not-a-curriculum-state"],
)
async def test_a_file_that_is_not_a_history_is_refused(
    open_client: Callable[..., Any], tmp_path: Path, content: str, message: str
) -> None:
    history = tmp_path / "curriculum.json"
    history.write_text(content)
    with pytest.raises(HistoryError, match=message):
        async with open_client(transitions=history):
            pass


async def test_a_history_of_another_curriculum_is_refused(
    open_client: Callable[..., Any], tmp_path: Path, old_run: OldRun
) -> None:
    with pytest.raises(
        HistoryError, match=r"it belongs to curriculum 'tiny' \(hash [0-9a-f]+\), but this server loaded"
    ):
        async with open_client(seed=99, transitions=old_run.history):
            pass
