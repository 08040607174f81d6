"""Other trainers' own reward clients against a real dataserver.

- OpenRLHF: its own client, ``SingleTurnAgentExecutor._fetch_rewards_via_http`` (``openrlhf/utils/agent.py``
  of openrlhf 0.11.2 from PyPI, installed without its GPU stack), called as its rollout calls it.
- slime: its ``remote_rm`` (``slime/rollout/rm_hub/__init__.py`` at THUDM/slime 624b824a) needs slime's
  Megatron stack to import, so its request is replayed as that function builds it: one aiohttp POST of
  ``{prompt, response, label}``, ``raise_for_status()``, and the JSON answer taken as the reward.
- verl: ``proctor.client.verl`` loaded and called as verl loads and calls a custom reward function
  (``verl/trainer/ppo/reward.py``'s ``get_custom_reward_fn`` and ``_call_with_kwargs``, then
  ``verl/workers/reward_manager/naive.py``'s and ``batch.py``'s calls, at volcengine/verl b178a3cd): verl
  itself does not import without its GPU stack.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import aiohttp
import httpx
import pytest

from tests.conftest import QA_ROWS

pytestmark = pytest.mark.e2e
ANSWERS = {row["q"]: row["a"] for row in QA_ROWS}


@pytest.fixture
def served(live_server: Callable[..., AbstractContextManager[str]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A real server (`add` grades what names no record) and a `qa` sample it served."""
    with live_server(peer_default_source="add") as url:
        samples = httpx.post(url + "/sample", json={"iteration": 10, "batch_size": 4}).json()["samples"]
        yield url, next(s for s in samples if s["dataset_id"] == "qa")


def test_openrlhfs_own_client(served: tuple[str, dict[str, Any]]) -> None:
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    url, sample = served
    executor = SingleTurnAgentExecutor(remote_rm_url=url + "/openrlhf/reward")
    prompt = f"<|im_start|>user\n{sample['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    query = prompt + ANSWERS[sample["prompt"]] + "<|im_end|>"
    # As its single-turn rollout calls it: one query, its prompt and its label.
    [info] = asyncio.run(executor._fetch_rewards_via_http([query], [prompt], [sample["sample_id"]]))
    assert info["rewards"] == [1.0] and info["scores"] == [1.0]
    assert info["extra_logs"]["exact_match"] == [1.0]
    [unlabelled] = asyncio.run(executor._fetch_rewards_via_http(["2+2? 4</s>"], ["2+2? "], ["4"]))
    assert unlabelled["rewards"] == [1.0]


def test_slimes_request(served: tuple[str, dict[str, Any]]) -> None:
    url, sample = served

    async def remote_rm(payload: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=64)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.post(url + "/slime/reward", json=payload) as resp,
        ):
            resp.raise_for_status()
            return await resp.json()

    right = {"prompt": sample["prompt"], "response": ANSWERS[sample["prompt"]], "label": sample["sample_id"]}
    assert asyncio.run(remote_rm(right)) == 1.0
    assert asyncio.run(remote_rm({"prompt": "3 + 4?", "response": "7", "label": "7"})) == 1.0
    with pytest.raises(aiohttp.ClientResponseError) as refused:
        asyncio.run(remote_rm({"prompt": "?", "response": "7", "label": "nope:0123456789:1"}))
    assert refused.value.status == 422


def _call_with_kwargs(raw_fn: Callable[..., Any], extra_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    # verl/trainer/ppo/reward.py: the configured reward_kwargs take precedence over the call's.
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


def test_verls_custom_reward_function(served: tuple[str, dict[str, Any]]) -> None:
    url, sample = served
    # custom_reward_function: {path: pkg://proctor.client.verl, name: ..., reward_kwargs: {proctor_url: URL}}
    module = importlib.import_module("pkg://proctor.client.verl"[len("pkg://") :].replace("/", "."))
    naive = partial(_call_with_kwargs, module.compute_score, {"proctor_url": url})
    score = naive(
        data_source="qa",
        solution_str=ANSWERS[sample["prompt"]],
        ground_truth="unused",
        extra_info={"sample_id": sample["sample_id"], "num_turns": None, "rollout_reward_scores": {}},
    )
    # The same keys for every sample (verl's reward loop reads the first answer's keys from all of them) ...
    assert score == {"score": 1.0, "grading_error": 0.0}
    # ... and each grader's score too where the config asks (every source with the same graders).
    with_graders = partial(_call_with_kwargs, module.compute_score, {"proctor_url": url, "components": True})
    assert with_graders(data_source="qa", solution_str="no", ground_truth=sample["sample_id"], extra_info={}) == {
        "score": 0.0,
        "exact_match": 0.0,
        "half": 0.5,
        "grading_error": 0.0,
    }
    assert naive(data_source="add", solution_str="9", ground_truth="9", extra_info={})["score"] == 1.0
    batch = partial(_call_with_kwargs, module.compute_score_batch, {"proctor_url": url})
    scores = batch(
        data_sources=["qa", "add"],
        solution_strs=["wrong", "10"],
        ground_truths=[sample["sample_id"], "11"],
        extra_infos=[{}, {}],
    )
    assert [s["score"] for s in scores] == [0.0, 0.0]
    module.close()
