"""Run by tests/e2e/test_refill_training.py under torchrun: ``ProctorGRPOTrainer(refill_rounds=R)`` on one or
two CPU processes against one dataserver.

Each rank writes every reward call's rows (in order) and the trainer's logs to OUT/rank<r>.json.
Arguments: URL MODEL OUT STEPS ROUNDS.
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

from proctor.client import ProctorClient, RemoteRLDataset
from proctor.client.rewards import RemoteReward
from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

PROMPTS = 3  # per generation step, across the processes
GENERATIONS = 4


CALLS: list[dict[str, Any]] = []


class RecordingReward(RemoteReward):
    """A store-backed reward function that keeps the rows of every call (in CALLS)."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
        CALLS.append({k: list(kwargs[k]) for k in ("sample_id", "slot", "completion_index", "iteration")})
        return super().__call__(*args, **kwargs)


def main(url: str, model: str, out: str, steps: int, rounds: int) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = ProctorGRPOConfig(
        **run_defaults(Path(out) / "run"),
        # A group's rows are split over the two processes where there are two.
        per_device_train_batch_size=PROMPTS * GENERATIONS // world,
        gradient_accumulation_steps=1,
        num_generations=GENERATIONS,
        max_completion_length=8,
        max_steps=steps,
        shuffle_dataset=False,
    )
    client = ProctorClient(url)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    reward = RecordingReward(client, dataset=dataset)
    trainer = ProctorGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        refill_rounds=rounds,
    )
    trainer.train()
    dataset.close()
    client.close()
    record = {
        "rank": config.process_index,
        "rows_per_process": config.per_device_train_batch_size,
        "calls": CALLS,
        "logs": trainer.state.log_history,
    }
    Path(out, f"rank{config.process_index}.json").write_text(json.dumps(record))
    # As tests/e2e/ddp_grpo.py: tear down the process group, then leave without tearing the interpreter down.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    url, model, out, steps, rounds = sys.argv[1:]
    main(url, model, out, int(steps), int(rounds))
