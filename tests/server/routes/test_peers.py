"""POST /score, /openrlhf/reward and /slime/reward through the ASGI transport: routing by label, the default
source, and refusals that name the field."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.conftest import QA_ROWS

pytestmark = pytest.mark.anyio

ANSWERS = {row["q"]: row["a"] for row in QA_ROWS}


@pytest.fixture
async def client(open_client: Callable[..., Any]) -> AsyncIterator[httpx.AsyncClient]:
    # `add` (graded by `numeric`) grades what names no record; iteration 10 of the tiny curriculum serves `qa`.
    async with open_client(peer_default_source="add", max_completion_chars=1000) as c:
        yield c


async def post(client: httpx.AsyncClient, path: str, body: Any, status: int = 200) -> Any:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


async def qa_sample(client: httpx.AsyncClient) -> dict[str, Any]:
    samples = (await post(client, "/sample", {"iteration": 10, "batch_size": 4}))["samples"]
    return next(s for s in samples if s["dataset_id"] == "qa")


async def test_a_sample_id_label_is_graded_by_its_record_and_stored(client: httpx.AsyncClient) -> None:
    sample = await qa_sample(client)
    answer = ANSWERS[sample["prompt"]]
    body = {
        "items": [{"response": answer, "label": sample["sample_id"]}, {"response": "no", "label": sample["sample_id"]}]
    }
    [right, wrong] = (await post(client, "/score", body))["results"]
    assert right == {
        "reward": 1.0,
        "components": {"exact_match": 1.0, "half": 0.5},
        "error": None,
        "sample_id": sample["sample_id"],
    }
    assert (wrong["reward"], wrong["components"]["exact_match"]) == (0.0, 0.0)
    # Stored like a /grade without iteration: the same completion is answered from the stored grade.
    item = {"sample_id": sample["sample_id"], "completion": answer}
    [again] = (await post(client, "/grade", {"items": [item]}))["results"]
    assert (again["reward"], again["cached"]) == (1.0, True)


async def test_any_other_label_is_the_default_sources_reference_answer(client: httpx.AsyncClient) -> None:
    body = {"items": [{"response": "The sum is 12", "label": "12"}, {"response": "13", "label": "12"}]}
    results = (await post(client, "/score", body))["results"]
    assert [(r["reward"], r["components"], r["sample_id"]) for r in results] == [
        (1.0, {"numeric": 1.0}, None),
        (0.0, {"numeric": 0.0}, None),
    ]


async def test_refusals_name_the_field(client: httpx.AsyncClient, open_client: Callable[..., Any]) -> None:
    sample = await qa_sample(client)
    version = sample["sample_id"].split(":")[1]
    cases = [
        (
            {"items": [{"response": "x", "label": "nope:0123456789:1"}]},
            "items[0].label: 'nope:0123456789:1' names source 'nope', which this server does not have",
        ),
        (
            {"items": [{"response": "x", "label": f"qa:{version}:6"}]},
            f"items[0].label: 'qa:{version}:6' names record 6; source 'qa' has 6",
        ),
        (
            {"items": [{"response": "x" * 1001, "label": "1"}]},
            "items[0].response: 1001 characters is above this server's maximum of 1000",
        ),
    ]
    for body, detail in cases:
        assert (await post(client, "/score", body, 422))["detail"].startswith(detail)
    missing = await post(client, "/score", {"items": [{"response": "x", "label": None, "surprise": 1}]}, 422)
    assert "surprise" in str(missing["detail"])
    huge = await client.post(
        "/score",
        content=b'{"items": [{"response": "' + b"x" * (10 * 1024 * 1024) + b'"}]}',
        headers={"Content-Type": "application/json"},
    )
    assert huge.status_code == 413
    async with open_client() as plain:  # no default source
        refused = await post(plain, "/score", {"items": [{"response": "Paris", "label": "Paris"}]}, 422)
        assert refused["detail"].startswith(
            "items[0].label: 'Paris' is not a sample id, so it names no record, and this server has no default source"
        )


async def test_openrlhf_queries_are_the_prompt_and_response_decoded_together(client: httpx.AsyncClient) -> None:
    sample = await qa_sample(client)
    prompt = f"<|im_start|>user\n{sample['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    body = {
        "query": [prompt + ANSWERS[sample["prompt"]] + "<|im_end|>", prompt + "Lyon<|im_end|><|endoftext|>"],
        "prompts": [prompt, prompt],
        "labels": [sample["sample_id"], sample["sample_id"]],
    }
    answer = await post(client, "/openrlhf/reward", body)
    assert answer == {
        "rewards": [1.0, 0.0],
        "scores": [1.0, 0.0],
        "extra_logs": {"exact_match": [1.0, 0.0], "half": [0.5, 0.5], "grading_errors": [0.0, 0.0]},
    }
    # Graders logged only where every query has them: a default-source query has `numeric` alone.
    mixed = await post(
        client,
        "/openrlhf/reward",
        {"query": ["p 7", body["query"][0]], "prompts": ["p ", prompt], "labels": ["7", sample["sample_id"]]},
    )
    assert mixed["rewards"] == [1.0, 1.0] and mixed["extra_logs"] == {"grading_errors": [0.0, 0.0]}


async def test_an_openrlhf_prompt_cut_from_the_left_is_still_taken_off(client: httpx.AsyncClient) -> None:
    # OpenRLHF keeps a long prompt's last tokens: the query starts inside the prompt it sends.
    prompt = "Think step by step. " * 50 + "What is 3 + 4? "
    body = {
        "query": [prompt[600:] + "7<|im_end|>", "What is 3 + 4? 7"],
        "prompts": [prompt, "What is 3 + 4? "],
        "labels": ["7", "7"],
    }
    assert (await post(client, "/openrlhf/reward", body))["rewards"] == [1.0, 1.0]


async def test_openrlhf_refusals_name_its_fields(client: httpx.AsyncClient) -> None:
    short = await post(client, "/openrlhf/reward", {"query": ["a", "b"], "prompts": ["a"], "labels": ["1", "2"]}, 422)
    assert "prompts has 1 entries and query 2: send one per query, in order" in str(short["detail"])
    long = await post(client, "/openrlhf/reward", {"query": ["1", "x" * 1001], "labels": ["1", "1"]}, 422)
    assert long["detail"].startswith("query[1]: 1001 characters")
    bad = await post(client, "/openrlhf/reward", {"query": ["1"], "labels": ["nope:0123456789:0"]}, 422)
    assert bad["detail"].startswith("labels[0]: 'nope:0123456789:0' names source 'nope'")


async def test_slime_gets_a_bare_number(client: httpx.AsyncClient) -> None:
    sample = await qa_sample(client)
    body = {
        "prompt": [{"role": "user", "content": sample["prompt"]}],
        "response": ANSWERS[sample["prompt"]],
        "label": sample["sample_id"],
    }
    assert await post(client, "/slime/reward", body) == 1.0
    assert await post(client, "/slime/reward", {"prompt": "2 + 2?", "response": "5", "label": "4"}) == 0.0
    assert await post(client, "/slime/reward", {"prompt": "2 + 2?", "response": "4", "label": 4}) == 1.0  # a number
    refused = await post(client, "/slime/reward", {"response": "x", "label": "nope:0123456789:0"}, 422)
    assert refused["detail"].startswith("label: 'nope:0123456789:0' names source 'nope'")
