"""Run by tests/e2e/test_grpo_ddp.py under torchrun: GRPO on two CPU processes against one dataserver.

Each rank writes what it asked the server for and what its reward function saw to OUT/rank<r>.json.
Arguments: URL MODEL OUT STEPS [THROUGH STEPS_PER_GENERATION RESUME SEED], THROUGH being ``grade`` (the
default) or ``store``, RESUME a checkpoint to resume from or ``-``.
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
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
from proctor.client.tiny import run_defaults


def main(
    url: str, model: str, out: str, steps: int, through: str = "grade", spg: int = 1, resume: str = "-", seed: int = 42
) -> None:
    # Through the store, a checkpoint at every step, so that a run can resume in the middle of a generation.
    saving = {"save_strategy": "steps", "save_steps": 1, "seed": seed} if through == "store" else {}
    config = GRPOConfig(
        **{**run_defaults(Path(out) / "run"), **saving},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        steps_per_generation=spg,
        num_generations=4,  # a prompt's four completions are split over the two processes
        max_completion_length=8,
        max_steps=steps,
        shuffle_dataset=False,
    )
    client = ProctorClient(url)
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    grade = remote_reward(client, dataset=dataset) if through == "store" else remote_reward(client)
    calls: list[dict[str, Any]] = []

    def proctor_reward(**kwargs: Any) -> list[float | None]:
        calls.append({k: list(kwargs[k]) for k in ("sample_id", "completion_index", "iteration")})
        return grade(**kwargs)

    trainer = GRPOTrainer(
        model=model, reward_funcs=proctor_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train(resume_from_checkpoint=None if resume == "-" else resume)
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
    url, model, out, steps, *more = sys.argv[1:]
    through, spg, resume, seed = [*more, "grade", "1", "-", "42"][:4] if more else ("grade", "1", "-", "42")
    main(url, model, out, int(steps), through, int(spg), resume, int(seed))
