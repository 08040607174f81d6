"""RemoteRLDataset against a real server: what TRL's loader would fetch, and what it costs in /sample calls."""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import datasets
import httpx
import pytest

from proctor.client import ProctorClient, TransportError
from proctor.client.dataset import RemoteRLDataset


def grpo_args(**overrides: Any) -> SimpleNamespace:
    """The GRPOConfig fields RemoteRLDataset reads, after GRPOConfig.__post_init__."""
    values: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "world_size": 1,
        "process_index": 0,
        "steps_per_generation": 2,
        "num_generations": 4,
        "shuffle_dataset": False,
        "max_steps": 10,
        "num_train_epochs": 3.0,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture
def server(live_server: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    with live_server() as url:
        yield url


@pytest.fixture
def client(server: str) -> Iterator[ProctorClient]:
    with ProctorClient(server) as c:
        yield c


def sample_calls(server: str) -> int:
    """/sample requests the server answered (from its metrics)."""
    text = httpx.get(server + "/metrics").text
    m = re.search(r'proctor_requests_total\{method="POST",route="/sample",status="200"\} ([0-9.]+)', text)
    return int(float(m.group(1))) if m else 0


def loader_batches(ds: RemoteRLDataset, steps: int) -> Iterator[list[int]]:
    """The loader batches TRL's RepeatSampler produces for one process (B=4, S=2, G=4, mu=1): each index G
    times in a row, each chunk of U prompts repeated S times, batches of B·S rows."""
    u = ds.layout.prompts_per_generation
    stream: list[int] = []
    for step in range(steps):
        chunk = [i for i in range(step * u, (step + 1) * u) for _ in range(4)]
        stream += chunk * 2
    rows = ds.layout.rows_per_process
    for start in range(0, len(stream), rows):
        yield stream[start : start + rows]


def test_refuses_a_shuffling_trainer(client: ProctorClient) -> None:
    with pytest.raises(ValueError, match=r"set GRPOConfig\(shuffle_dataset=False\)"):
        RemoteRLDataset(client, grpo_args(shuffle_dataset=True))


def test_refuses_replaying_the_curriculum_in_a_second_epoch(client: ProctorClient) -> None:
    with pytest.raises(ValueError, match=r"set GRPOConfig\(max_steps=\.\.\.\) or num_train_epochs=1"):
        RemoteRLDataset(client, grpo_args(max_steps=-1, num_train_epochs=3.0))
    RemoteRLDataset(client, grpo_args(max_steps=-1, num_train_epochs=1.0)).close()


def test_length_and_type(client: ProctorClient) -> None:
    ds = RemoteRLDataset(client, grpo_args())
    assert isinstance(ds, datasets.Dataset)
    assert ds.layout.prompts_per_generation == 2  # B·P·S/G = 4·1·2/4
    assert len(ds) == 30 * 2  # total_iterations of the tiny curriculum × prompts per step
    assert ds.column_names == ["index"]
    ds.close()


def test_one_sample_request_per_generation_step(client: ProctorClient, server: str) -> None:
    ds = RemoteRLDataset(client, grpo_args(), prefetch=False)
    for batch in loader_batches(ds, steps=3):
        ds.__getitems__(batch)
        ds.__getitems__(batch)  # TRL fetches every loader batch S·μ times
    assert ds.requested == [0, 1, 2]
    assert sample_calls(server) == 3
    ds.close()


def test_the_next_step_is_prefetched(client: ProctorClient) -> None:
    ds = RemoteRLDataset(client, grpo_args())
    ds.__getitems__([0, 0, 0, 0, 1, 1, 1, 1])
    deadline = time.monotonic() + 10
    while ds.requested != [0, 1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.requested == [0, 1]
    ds.__getitems__([2, 2, 2, 2, 3, 3, 3, 3])  # step 1 comes from the prefetch, step 2 is prefetched now
    while len(ds.requested) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.requested == [0, 1, 2]
    ds.close()


def test_rows_carry_the_server_batch(client: ProctorClient) -> None:
    ds = RemoteRLDataset(client, grpo_args(), prefetch=False)
    rows = ds.__getitems__([2, 2, 2, 2, 3, 3, 3, 3])  # generation step 1, slots 0 and 1
    batch = client.sample(1, 2)
    assert [r["sample_id"] for r in rows] == [batch.samples[0].sample_id] * 4 + [batch.samples[1].sample_id] * 4
    assert [r["completion_index"] for r in rows] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {r["iteration"] for r in rows} == {1}
    assert {r["stage"] for r in rows} == {"warm"}
    assert rows[0]["dataset_id"] == "add"
    assert rows[0]["metadata"] == batch.samples[0].metadata
    ds.close()


def test_prompts_are_conversational_with_a_chat_template(client: ProctorClient) -> None:
    chat = RemoteRLDataset(client, grpo_args(), processing_class=SimpleNamespace(chat_template="{{ x }}"))
    text = RemoteRLDataset(client, grpo_args(), processing_class=SimpleNamespace(chat_template=None))
    sample = client.sample(0, 2).samples[0]
    assert chat[0]["prompt"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": sample.prompt},
    ]
    assert text[0]["prompt"] == f"Answer briefly.\n\n{sample.prompt}"
    chat.close()
    text.close()


def test_completion_index_counts_across_processes(client: ProctorClient) -> None:
    # B=2, P=2, S=1, G=4: one prompt per step whose four completions are split over the two processes.
    args = grpo_args(per_device_train_batch_size=2, world_size=2, steps_per_generation=1)
    rank0 = RemoteRLDataset(client, args, process_index=0, prefetch=False)
    rank1 = RemoteRLDataset(client, args, process_index=1, prefetch=False)
    rows0, rows1 = rank0.__getitems__([5, 5]), rank1.__getitems__([5, 5])
    assert [r["completion_index"] for r in rows0 + rows1] == [0, 1, 2, 3]
    assert {r["sample_id"] for r in rows0 + rows1} == {client.sample(5, 1).samples[0].sample_id}
    rank0.close()
    rank1.close()


def test_the_transform_pickles_for_dataloader_workers(client: ProctorClient) -> None:
    ds = RemoteRLDataset(client, grpo_args(), prefetch=False)
    copy = pickle.loads(pickle.dumps(ds.fetcher))
    assert copy.requested == []
    assert copy({"index": [0]})["sample_id"] == [ds[0]["sample_id"]]
    assert copy.requested == [0]
    ds.close()
    copy.close()


def test_a_failed_fetch_is_tried_again_when_the_step_is_read(client: ProctorClient, server: str) -> None:
    ds = RemoteRLDataset(client, grpo_args(), prefetch=False)
    broken = ProctorClient("http://127.0.0.1:9", retries=0)  # nothing listens on the discard port
    ds.fetcher.client = broken
    with pytest.raises(TransportError):
        ds.__getitems__([0])
    ds.fetcher.client = client  # the server is back
    assert ds.__getitems__([0])[0]["sample_id"] == client.sample(0, 2).samples[0].sample_id
    assert ds.requested == [0, 0]
    broken.close()
    ds.close()
