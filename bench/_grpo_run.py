"""A short GRPO run of the tiny model against a dataserver, timed per step: what the grading benchmark needs
of the `train` extra, kept apart so that its scale-out part runs without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from transformers import AutoTokenizer, PrinterCallback
from trl import GRPOConfig  # type: ignore[attr-defined]

from bench._timing import StepTimes
from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOTrainer

__all__ = ["WARMUP", "train_steps"]

WARMUP = 3
BATCH, GENERATIONS = 8, 4  # 2 prompts × 4 completions per step


def train_steps(url: str, model: Path, out: Path, steps: int, through: Literal["store", "grade"]) -> list[float]:
    """Milliseconds of each step after the warm-up, with a reference model (beta > 0)."""
    config = GRPOConfig(
        **run_defaults(out),
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=16,
        max_steps=steps,
        beta=0.04,
        learning_rate=1e-4,
        shuffle_dataset=False,
    )
    timer = StepTimes()
    tokenizer = AutoTokenizer.from_pretrained(model)
    with ProctorClient(url) as client:
        dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
        trainer = ProctorGRPOTrainer(
            model=str(model),
            reward_funcs=remote_reward(client, dataset=dataset, through=through),
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        dataset.close()
    return timer.times[WARMUP:]
