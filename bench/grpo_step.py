"""A GRPO step on the CPU: stock ``GRPOTrainer`` against ``ProctorGRPOTrainer`` with chunked passes and with
token-budget packing, side by side in one run.

Each variant trains in a fresh process (peak memory is a per-process high-water mark, so variants cannot
share one), and the variants alternate over rounds so that drifts of the machine hit them alike. The model is
built from a config (4 layers, hidden 256) with the offline tiny tokenizer; the run has a reference model
(beta > 0) and an old-policy pass (num_iterations = 2), so all three passes the trainer batches are exercised.
Prompts have varied lengths, and an exponentially growing EOS bonus after 8 tokens makes completions end at
spread-out lengths, as a trained model's do; that spread is where packing pays.

Where a GPU is available, the same variants run on it with a model of a few hundred million parameters
(``--gpu``); this project's machines have none, so that table is not in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._results import save

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "chunked", "dynamic")
STEPS, WARMUP, ROUNDS = 12, 2, 2


def _run_variant(variant: str, model_dir: Path, out: Path, gpu: bool) -> None:
    """Train one variant in this process and write its step times and peak memory to ``out``."""
    import datasets
    import torch
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

    from bench._timing import StepTimes
    from proctor.client.tiny import run_defaults
    from proctor.client.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = "what is one two three four five add sum plus the answer of seven nine".split()
    rows = [" ".join(words[(i * 3 + j) % len(words)] for j in range(3 + (i * 7) % 23)) for i in range(256)]
    dataset = datasets.Dataset.from_dict({"prompt": rows})

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [min(1.0, len(c) / 80) for c in completions]

    common: dict[str, Any] = {
        **run_defaults(out.parent / f"run-{variant}", gpu=gpu),
        "per_device_train_batch_size": 32,
        "num_generations": 4,
        "max_completion_length": 96,
        "max_steps": STEPS,
        "learning_rate": 1e-5,
        "beta": 0.04,
        "num_iterations": 2,
        "gradient_accumulation_steps": 1,
        # A random model rarely says EOS; this makes completions end at spread-out lengths, as trained ones do.
        "generation_kwargs": {"exponential_decay_length_penalty": (8, 1.1)},
    }
    if variant == "stock":
        config: Any = GRPOConfig(**common)
        trainer_cls: Any = GRPOTrainer
    else:
        # chunked: every pass in chunks of 8 rows (generation included). dynamic: generation whole, as stock,
        # and the three log-prob passes packed by a token budget.
        knobs: dict[str, Any] = {}
        if variant == "chunked":
            knobs = {"rollout_micro_batch_size": 8, "ref_logps_micro_batch_size": 8, "old_logps_micro_batch_size": 8}
        else:
            knobs = {
                "use_dynamic_batching_in_infer": True,
                "max_tokens_per_microbatch_in_infer": 1024,
                "use_dynamic_batching_in_train": True,
                "max_tokens_per_microbatch_in_train": 1024,
                "sequence_length_round_in_infer": 8,
                "sequence_length_round_in_train": 8,
            }
        config = ProctorGRPOConfig(**common, **knobs)
        trainer_cls = ProctorGRPOTrainer

    timer = StepTimes()
    trainer = trainer_cls(
        model=str(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.train()
    result = {
        "variant": variant,
        "step_ms": timer.times[WARMUP:],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_train_mib": rss_before,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if gpu else None,
        "calls": len(trainer.batching_log.logps_calls) if variant != "stock" else None,
    }
    out.write_text(json.dumps(result))


def _build_model(folder: Path, *, gpu: bool) -> Path:
    from proctor.client.tiny import build_tiny_model

    # about 365M parameters on a GPU, 4M on the CPU
    if gpu:
        return build_tiny_model(folder / "model", hidden_size=1024, layers=24, heads=16, kv_heads=4, mlp_ratio=4)
    return build_tiny_model(folder / "model", hidden_size=256, layers=4, heads=8, kv_heads=4, mlp_ratio=4)


def run(gpu: bool = False) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proctor-grpo-step-") as tmp:
        model_dir = _build_model(Path(tmp), gpu=gpu)
        for round_ in range(ROUNDS):
            for variant in VARIANTS:
                out = Path(tmp) / f"{variant}-{round_}.json"
                cmd = [sys.executable, "-m", "bench.grpo_step", "--variant", variant, "--model", str(model_dir)]
                cmd += ["--out", str(out)] + (["--gpu"] if gpu else [])
                env = {**os.environ, "PYTHONWARNINGS": "ignore"}
                subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
                results.append(json.loads(out.read_text()))
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | steps | step ms (median) | vs stock | peak RSS MiB | peak GPU MiB | log-prob forwards per step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    medians: dict[str, float] = {}
    for variant in VARIANTS:
        rs = [r for r in results if r["variant"] == variant]
        steps = [t for r in rs for t in r["step_ms"]]
        medians[variant] = statistics.median(steps)
        peak = max(r["peak_rss_mib"] for r in rs)
        gpu = max((r["peak_gpu_mib"] or 0) for r in rs) or None
        calls = rs[0]["calls"]
        per_step = f"{calls / STEPS:.1f}" if calls is not None else "3 (one per pass)"
        lines.append(
            f"| {variant} | {len(steps)} | {medians[variant]:.0f} | {medians[variant] / medians['stock']:.2f} | "
            f"{peak:.0f} | {'' if gpu is None else f'{gpu:.0f}'} | {per_step} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    if args.variant:
        _run_variant(args.variant, args.model, args.out, args.gpu)
        return
    results = run(gpu=args.gpu)
    device = "GPU" if args.gpu else "CPU"
    print(f"GRPO step on the {device}: 32 rows (8 prompts × 4), completions ≤ 96 tokens, beta 0.04, num_iterations 2")
    print(table(results))
    save(f"grpo_step_{device.lower()}", results)


if __name__ == "__main__":
    main()
