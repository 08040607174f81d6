"""Run by tests/e2e/test_grpo_balance.py under torchrun: one GRPO step on two CPU processes, once per variant.

Completions are fixed token sequences, long on process 0 and short on process 1, so that the processes' token
loads differ. Process 0 writes each variant's gradients (after the all-reduce) and batching metrics to
OUT/<variant>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import datasets
import torch
import torch.distributed
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

# Completion lengths of each process's four rows: a long tail on process 0.
LENGTHS = {0: [40, 3, 28, 2], 1: [2, 3, 4, 2]}


class FixedCompletions:
    def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[Any, None]:
        rank = self.accelerator.process_index  # type: ignore[attr-defined]
        g = torch.Generator().manual_seed(100 + rank)
        return [torch.randint(10, 400, (n,), generator=g).tolist() for n in LENGTHS[rank][: len(prompt_ids)]], None


class Stock(FixedCompletions, GRPOTrainer):
    pass


class Proctor(FixedCompletions, ProctorGRPOTrainer):
    pass


class Gradients(TrainerCallback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train(variant: str, model: str, out: Path) -> None:
    loss_type, _, batching = variant.partition("-")
    common: dict[str, Any] = {
        **run_defaults(out / variant),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 48,
        "max_steps": 1,
        "max_grad_norm": 0.0,  # no clipping: compare the raw all-reduced gradients
        "loss_type": loss_type,
        "beta": 0.04,
        "shuffle_dataset": False,
    }
    if batching == "stock":
        config: Any = GRPOConfig(**common)
        cls: Any = Stock
    else:
        config = ProctorGRPOConfig(
            **common,
            use_dynamic_batching_in_train=True,
            max_tokens_per_microbatch_in_train=64,
            balance_ranks_by_tokens=batching == "balanced",
        )
        cls = Proctor
    grads = Gradients()
    trainer = cls(
        model=model,
        reward_funcs=lambda completions, **_: [len(c) / 100 for c in completions],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["what is one", "add two and three"] * 4}),
        processing_class=AutoTokenizer.from_pretrained(model),
        callbacks=[grads],
    )
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("batching/")}
    if config.process_index == 0:
        torch.save({"grads": grads.grads, "logs": logs}, out / f"{variant}.pt")


def main(model: str, out: str, variants: list[str]) -> None:
    for variant in variants:
        train(variant, model, Path(out))
    # See ddp_grpo.py: leave without tearing the interpreter down, once the process group is gone.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
