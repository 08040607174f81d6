"""A run resumed from a checkpoint taken in the middle of a generation trains the micro-steps the uninterrupted
run trained, on the same rows; stock TRL regenerates and shifts its schedule there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

pytestmark = pytest.mark.e2e  # whole GRPO runs, checkpointed and resumed

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = "what is one two three four five add sum plus the answer".split()
PROMPTS = [f"{WORDS[i % len(WORDS)]} {WORDS[(i * 5 + 1) % len(WORDS)]} {i}" for i in range(16)]


class Recorded:
    """Records, per optimizer step, the iterations (prompt pairs) and completions it trained on."""

    steps: list[tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]]]

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        tok = self.processing_class  # type: ignore[attr-defined]
        prompts = tok.batch_decode(inputs["prompt_ids"], skip_special_tokens=True)
        iterations = tuple(sorted({PROMPTS.index(text.strip()) // 2 for text in prompts}))
        completions = tuple(sorted(tuple(row.tolist()) for row in inputs["completion_ids"]))
        self.steps.append((self.state.global_step + 1, iterations, completions))  # type: ignore[attr-defined]
        return super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]


class RecordedProctor(Recorded, ProctorGRPOTrainer):
    pass


class RecordedStock(Recorded, GRPOTrainer):
    pass


def run(tiny_model: Path, out: Path, cls: type[Any], config_cls: type[GRPOConfig], resume: Path | None) -> Any:
    args = config_cls(
        **{
            **run_defaults(out),
            "save_strategy": "steps",
            "save_steps": 3,
            "per_device_train_batch_size": 4,
            "num_generations": 4,  # 2 prompts per generation, one iteration of the schedule
            "gradient_accumulation_steps": 1,
            "steps_per_generation": 2,
            "max_completion_length": 6,
            "max_steps": 6,
            "learning_rate": 1e-2,
            "shuffle_dataset": False,
        }
    )
    t = cls(
        model=str(tiny_model),
        reward_funcs=lambda completions, **_: [len(c) / 20 for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )
    t.steps = []
    t.train(resume_from_checkpoint=str(resume) if resume else None)
    return t


def test_a_run_resumed_mid_generation_follows_the_uninterrupted_schedule(tiny_model: Path, tmp_path: Path) -> None:
    first = run(tiny_model, tmp_path / "first", RecordedProctor, ProctorGRPOConfig, None)
    schedule = [(step, its) for step, its, _ in first.steps]
    assert schedule == [(1, (0,)), (2, (0,)), (3, (1,)), (4, (1,)), (5, (2,)), (6, (2,))]
    checkpoint = tmp_path / "first" / "checkpoint-3"
    assert (checkpoint / "proctor-rollout-buffer-0.pt").exists()  # step 3 is half-way through iteration 1
    assert not (tmp_path / "first" / "checkpoint-6" / "proctor-rollout-buffer-0.pt").exists()  # at a boundary

    resumed = run(tiny_model, tmp_path / "resumed", RecordedProctor, ProctorGRPOConfig, checkpoint)
    # Steps 4-6 on iterations 1, 2, 2, as in the first run, and step 4 on the very rows the first run had buffered;
    # the weights, random state and data order are the checkpoint's, so the later generations agree too.
    assert resumed.steps == first.steps[3:]

    stock = run(tiny_model, tmp_path / "stock", RecordedStock, GRPOConfig, checkpoint)
    # Stock TRL regenerates at step 4 and shifts the schedule by one micro-step from there.
    assert [(step, its) for step, its, _ in stock.steps] == [(4, (1,)), (5, (1,)), (6, (2,))]
