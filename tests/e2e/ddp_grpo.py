"""Run by tests/e2e/test_grpo_ddp.py under torchrun: GRPO on two CPU processes against one dataserver.

Each rank writes what it asked the server for and what its reward function saw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch.distributed
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
from proctor.client.tiny import run_defaults


def main(url: str, model: str, out: str, steps: int) -> None:
    config = GRPOConfig(
        **run_defaults(Path(out) / "run"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_generations=4,  # a prompt's four completions are split over the two processes
        max_completion_length=8,
        max_steps=steps,
        shuffle_dataset=False,
    )
    client = ProctorClient(url)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    grade = remote_reward(client)
    calls: list[dict[str, Any]] = []

    def proctor_reward(**kwargs: Any) -> list[float | None]:
        calls.append({k: list(kwargs[k]) for k in ("sample_id", "completion_index", "iteration")})
        return grade(**kwargs)

    trainer = GRPOTrainer(
        model=model, reward_funcs=proctor_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    dataset.close()
    client.close()
    record = {"rank": config.process_index, "world": config.world_size, "requested": dataset.requested, "calls": calls}
    Path(out, f"rank{config.process_index}.json").write_text(json.dumps(record))
    # Left to interpreter exit, the process group's threads are destroyed while still joinable, and the C++
    # runtime aborts the process ("terminate called without an active exception"), now and then under load.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # And freeing the trainer's DDP reducer can deadlock with gloo's worker thread over the GIL (seen under
    # load: ~ProcessGroupGloo waits on a mutex the worker holds while it waits for the GIL). Everything this
    # rank reports is written: leave without tearing the interpreter down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
