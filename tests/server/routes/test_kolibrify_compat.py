"""kolibrify's trainer speaks to proctor unchanged: the exact request shapes its client sends, and the
fields it reads back (its RemoteRLDataset and remote reward function, kolibrify/rl/{data,rewards}.py)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.anyio


async def test_kolibrify_dataset_and_reward_round_trip(client: httpx.AsyncClient) -> None:
    # Dataset side: GET /meta for total_iterations, then POST /sample {iteration, batch_size} per step.
    meta = (await client.get("/meta")).json()
    assert isinstance(meta["total_iterations"], int)
    assert all({"name", "until_step"} <= set(stage) for stage in meta["stages"])
    response = await client.post("/sample", json={"iteration": 0, "batch_size": 4})
    response.raise_for_status()
    rows = []
    for sample in response.json().get("samples", []):
        rows.append(
            {
                "sample_id": sample.get("sample_id"),
                "prompt": sample.get("prompt", ""),
                "metadata": sample.get("metadata"),
            }
        )
        assert isinstance(sample.get("system_prompt"), str)
    assert len(rows) == 4

    # Reward side: num_generations completions per prompt, flattened; completion_index is the position in
    # the flat list, iteration is the trainer's global_step, completion_tokens may be null.
    generations = 3
    flat_ids = [row["sample_id"] for row in rows for _ in range(generations)]
    completions = [f"answer {n}" for n in range(len(flat_ids))]
    payload = {
        "iteration": 0,
        "items": [
            {"sample_id": sid, "completion": text, "completion_tokens": None if idx % 2 else 7, "completion_index": idx}
            for idx, (sid, text) in enumerate(zip(flat_ids, completions, strict=True))
        ],
    }
    response = await client.post("/grade", json=payload)
    response.raise_for_status()
    reward_map = {item["completion_index"]: item["reward"] for item in response.json().get("results", [])}
    assert sorted(reward_map) == list(range(len(flat_ids)))
    assert all(isinstance(r, float) for r in reward_map.values())
