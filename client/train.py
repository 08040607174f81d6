"""``proctor train``: GRPO with TRL against a running dataserver (``proctor demo`` runs it, in ``proctor.cli.demo``).

    proctor train --server http://127.0.0.1:8000 --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 200
    proctor train --model tiny            # a tiny model built offline (no hub), for trying things on a CPU

Prompts come from the server's curriculum (``RemoteRLDataset``) and rewards from its graders
(``remote_reward``); each step prints the curriculum stage and the mean reward.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from proctor.client.dataset import RemoteRLDataset
from proctor.client.http import ProctorClient
from proctor.client.rewards import remote_reward
from proctor.client.tiny import build_tiny_model, run_defaults

__all__ = ["StepReporter", "build_parser", "main", "train"]

TINY = "tiny"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="proctor train", description="GRPO (TRL) against a proctor dataserver.")
    p.add_argument("--server", default=os.environ.get("PROCTOR_URL", "http://127.0.0.1:8000"), help="dataserver URL")
    p.add_argument("--api-key", default=os.environ.get("PROCTOR_API_KEY"), help="the server's PROCTOR_API_KEY")
    p.add_argument("--model", default=TINY, help="a Hugging Face model path or id; 'tiny' builds one offline")
    p.add_argument("--tiny-dir", default=".proctor/tiny-model", help="where the tiny model is built")
    p.add_argument("--output-dir", default="runs/proctor-grpo")
    p.add_argument("--per-device-train-batch-size", type=int, default=8, help="completions per device and step")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the whole curriculum)")
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=None, help="default 1e-4 for tiny, 1e-6 otherwise")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-error", choices=["skip", "server"], default="skip", help="reward of a failed grading")
    p.add_argument("--save", action="store_true", help="save the trained model to --output-dir")
    return p


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run GRPO as ``args`` say; returns a summary (steps, rewards per step, curriculum transitions)."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    tiny = args.model == TINY
    model = str(build_tiny_model(args.tiny_dir)) if tiny else args.model
    if tiny:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = ProctorClient(args.server, api_key=args.api_key)
    client.wait_ready()
    meta = client.meta()
    gpu = torch.cuda.is_available()
    config = GRPOConfig(
        **run_defaults(args.output_dir, gpu=gpu, seed=args.seed),
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate or (1e-4 if tiny else 1e-6),
        beta=args.beta,
        temperature=args.temperature,
        # One optimizer step per generation step by default (steps_per_generation = gradient accumulation).
        max_steps=args.max_steps or meta.total_iterations,
        shuffle_dataset=False,  # the curriculum's order is the point
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    progress = StepReporter(dataset, is_main=config.process_index == 0)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=remote_reward(client, on_error=args.on_error, dataset=dataset),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[progress],
    )
    # The reporter prints one line per step; transformers' own printer would add the whole logs dict.
    trainer.remove_callback(PrinterCallback)
    if config.process_index == 0:
        print(
            f"training {model} on {meta.curriculum!r} ({meta.total_iterations} iterations, "
            f"{dataset.layout.prompts_per_generation} prompts × {config.num_generations} completions per step) "
            f"for {config.max_steps} steps",
            flush=True,
        )
    trainer.train()
    dataset.close()
    if args.save:
        trainer.save_model(args.output_dir)
    state = client.curriculum()
    client.close()
    if config.process_index == 0:
        print("curriculum transitions:")
        for t in state.transitions or []:
            print(f"  iteration {t.iteration:>4}: {t.from_stage} → {t.to_stage} ({t.reason})")
        if not state.transitions:
            print("  none")
    return {"steps": progress.steps, "transitions": [t.model_dump() for t in state.transitions]}


class StepReporter(TrainerCallback):
    """Prints one line per optimizer step: step, generation iteration, curriculum stage, mean reward."""

    def __init__(self, dataset: RemoteRLDataset, *, is_main: bool = True) -> None:
        self.dataset = dataset
        self.is_main = is_main
        self.steps: list[dict[str, Any]] = []
        self._started = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
        if not logs or "reward" not in logs:
            return
        iteration = int(logs.get("proctor/iteration", -1))
        entry = {
            "step": state.global_step,
            "iteration": iteration,
            "stage": self.dataset.stage_of(iteration),
            "reward": logs["reward"],
        }
        self.steps.append(entry)
        if self.is_main:
            print(
                f"step {entry['step']:>4}  iteration {iteration:>4}  stage {entry['stage']:<12} "
                f"reward {entry['reward']:.3f}  ({time.perf_counter() - self._started:.0f}s)",
                flush=True,
            )


def main(argv: Sequence[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
