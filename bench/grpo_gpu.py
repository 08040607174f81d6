"""GRPO on a GPU, per phase: peak memory and tokens/s of generation, the old-policy and reference log-prob passes
and the training pass, for stock ``GRPOTrainer`` and ``ProctorGRPOTrainer`` chunked and packed by token budget.

``python -m bench.grpo_gpu --out results.json [--shapes 0.5b,1.5b] [--budgets 16384,32768]`` (see ``--help``).
It needs a CUDA device and a CUDA build of torch, and exits with a message where there is none;
``--cpu-smoke`` runs the same code path on the CPU with a tiny shape and small sizes, to check the script.

Models are randomly initialised from a config, nothing is downloaded: Qwen2.5-0.5B's shape (hidden 896, 24
layers, 14 heads, 2 KV heads, MLP 4864) and 1.5B's (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960),
vocabulary 151,936, tied embeddings, bf16, with ``attn_implementation`` "sdpa" and, where ``flash_attn`` is
importable, also "flash_attention_2". The tokenizer is the offline tiny one (``proctor.client.tiny``, a few
hundred ids, all inside the model's vocabulary); ids beyond it are never sampled. Each variant runs in a fresh
process, so that its peak memory is its own and an out-of-memory error ends only that variant.

Each run: 8 prompts × 8 completions (64 rows), one micro-step per generation (``per_device_train_batch_size`` =
64, gradient accumulation 1: stock TRL's passes are then one forward over all rows), beta 0.04 (a reference
model) and num_iterations 2 (an old-policy pass), gradient checkpointing on, ``--steps`` optimizer steps (default
2: one generation, then one step on the same completions). Completion lengths are forced to a fixed long tail
(7 rows in 8 log-uniform over 64–1,024 tokens, 1 in 8 between 3,482 and 4,096, one of them exactly 4,096), the
same for every variant (``bench.grpo_step.ForcedLengths``).

Variants:

- ``stock``: ``GRPOTrainer``.
- ``chunked``: generation in chunks of half the rows, old/ref passes in chunks of a quarter.
- ``dynamic B`` for each budget B: old/ref and training passes packed into micro-batches of at most B tokens
  (rows × padded width), the training pass running forward and backward per micro-batch; lengths rounded to 64,
  padding-free where the model keeps packed sequences apart (the trainer's ``padding_free="auto"``).
  Two budgets show that the log-prob and training passes' peak follows the budget, not the batch.
- ``probe stock`` and ``probe dynamic B`` (the smallest budget): ``--probe-prompts`` (16) prompts × 8, stock and
  packed; records whether each ran out of memory (``torch.cuda.OutOfMemoryError``) and in which phase.

Per phase (``bench.grpo_step.PhaseTimes``, mixed into the trainer classes): wrappers around
``_generate_single_turn`` (generation), the no-grad calls of ``_get_per_token_logps_and_entropies`` (the old and
reference passes), and ``training_step`` after ``_prepare_inputs`` returns (the training pass: forward, loss and
backward; the optimizer step is outside it). Each phase starts with ``torch.cuda.synchronize()`` and
``torch.cuda.reset_peak_memory_stats()`` and ends with ``synchronize()`` and ``torch.cuda.max_memory_allocated()``,
so a phase's peak includes what is resident: the weights, the reference model, and from the first optimizer step
on the optimizer state (the ``resident`` column: the most allocated when a training pass starts; with the default
2 steps, generation and the log-prob passes run before the first optimizer step, so without optimizer state).
Tokens/s: the phase's real tokens (generated tokens for generation; prompt + completion tokens for the others,
padding excluded) over its wall time. The ``computed ÷ real`` columns are the padding the passes computed,
counted by a forward pre-hook on the models. Wrapping the methods rather than using TRL's ``profiling_context``
gives a peak per phase and a training phase that includes the backward.

With ``--steps`` 4 or more, times skip the first generation cycle (2 steps, warm-up); peaks never skip.
``--resume`` keeps the variants already in ``--out`` and runs the rest, and ``--variants`` names the ones to run,
so a long run can be split over several commands (the file is rewritten after every variant): generation takes
most of the time, since every variant decodes ``--max-completion-length`` steps at least once (the chunked one
once per chunk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTION = "GRPO on a GPU, per phase: peak memory and tokens/s, stock TRL against chunked and packed passes."
GENERATIONS = 8
VOCAB = 151_936
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
    },
    # --cpu-smoke: the same code path in seconds
    "smoke": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}
SMOKE: dict[str, Any] = {
    "prompts": 2,
    "probe_prompts": 4,
    "max_len": 64,
    "budgets": [256, 512],
    "vocab": 1024,
    "round": 8,
}


def long_tail(rows: int, max_len: int) -> list[int]:
    """The forced completion lengths: 7 in 8 log-uniform over max_len/64 … max_len/4, 1 in 8 near max_len."""
    from bench.grpo_step import long_tail_lengths

    return long_tail_lengths(rows, max_len, short=(max(2, max_len // 64), max(4, max_len // 4)))


def variants(budgets: Sequence[int], prompts: int, probe_prompts: int) -> list[dict[str, Any]]:
    """The runs of one shape and attention implementation: name, prompts, trainer knobs (None: stock TRL)."""
    rows = prompts * GENERATIONS
    out: list[dict[str, Any]] = [
        {"variant": "stock", "prompts": prompts, "knobs": None},
        {
            "variant": "chunked",
            "prompts": prompts,
            "knobs": {
                "rollout_micro_batch_size": max(1, rows // 2),
                "old_logps_micro_batch_size": max(1, rows // 4),
                "ref_logps_micro_batch_size": max(1, rows // 4),
            },
        },
    ]
    out += [{"variant": f"dynamic {b}", "prompts": prompts, "knobs": {"budget": b}} for b in budgets]
    out.append({"variant": "probe stock", "prompts": probe_prompts, "knobs": None})
    smallest = min(budgets)
    out.append({"variant": f"probe dynamic {smallest}", "prompts": probe_prompts, "knobs": {"budget": smallest}})
    return out


def _dynamic_knobs(budget: int, round_to: int) -> dict[str, Any]:
    return {
        "use_dynamic_batching_in_infer": True,
        "max_tokens_per_microbatch_in_infer": budget,
        "sequence_length_round_in_infer": round_to,
        "use_dynamic_batching_in_train": True,
        "max_tokens_per_microbatch_in_train": budget,
        "sequence_length_round_in_train": round_to,
    }


# --- one variant, in its own process ---------------------------------------------------------------------------


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the variant ``spec`` describes in this process; an out-of-memory error is a result, not a failure."""
    import datasets
    import torch
    from datasets.table import InMemoryTable
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

    from bench._timing import StepTimes
    from bench.grpo_step import batching_metrics, bench_trainer, phase_summary, spread
    from proctor.client.tiny import run_defaults
    from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

    gpu = not spec["smoke"]
    torch.manual_seed(0)
    model_dir = Path(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = spec["prompts"] * GENERATIONS
    words = "what is one two three four five add sum plus the answer of seven nine".split()
    span = 4 if spec["smoke"] else 112  # prompts of 16 … 127 words (smoke: 3 … 6)
    first = 3 if spec["smoke"] else 16
    prompts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(first + (i * 37) % span)) for i in range(512)]
    # from_dict fingerprints the table by pickling it with dill, which fails on some Python and pyarrow pairs
    # (Python 3.12.3 with pyarrow 26: "Can't pickle <class 'MonthDayNano'>"); the prompts' own hash is exact.
    table = InMemoryTable.from_pydict({"prompt": prompts})
    fingerprint = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]
    dataset = datasets.Dataset(table, fingerprint=fingerprint)

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [min(1.0, len(c) / 400) for c in completions]

    common: dict[str, Any] = {
        **run_defaults(Path(spec["workdir"]) / "run", gpu=gpu),
        "per_device_train_batch_size": rows,
        "num_generations": GENERATIONS,
        "max_completion_length": spec["max_len"],
        "max_steps": spec["steps"],
        "learning_rate": 1e-6,
        "beta": 0.04,
        "num_iterations": 2,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "model_init_kwargs": {"dtype": "bfloat16" if gpu else "float32", "attn_implementation": spec["attn"]},
    }
    knobs = spec["knobs"]
    if knobs is None:
        config: Any = GRPOConfig(**common)
        base: type[Any] = GRPOTrainer
        trainer_knobs: dict[str, Any] = {}
    else:
        trainer_knobs = _dynamic_knobs(knobs["budget"], spec["round"]) if "budget" in knobs else dict(knobs)
        config = ProctorGRPOConfig(**common, **trainer_knobs)
        base = ProctorGRPOTrainer
    result: dict[str, Any] = {
        key: spec[key] for key in ("shape", "attn", "variant", "prompts", "max_len", "steps", "gradient_checkpointing")
    }
    result |= {"rows": rows, "trainer": base.__name__, "knobs": trainer_knobs}
    result["device"] = torch.cuda.get_device_name() if gpu else "CPU (--cpu-smoke)"
    timer = StepTimes()
    trainer = bench_trainer(base)(
        model=str(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
        forced_lengths=long_tail(rows, spec["max_len"]),
        vocab_limit=len(tokenizer),
    )
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
        result |= {"status": "ok", "oom_phase": None}
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError, or a library's own "out of memory" (cuBLAS)
        if not isinstance(error, torch.cuda.OutOfMemoryError) and "out of memory" not in str(error).lower():
            raise
        phase = trainer.current_phase or "optimizer step"  # outside the phases: the optimizer step
        result |= {"status": "oom", "oom_phase": phase, "error": str(error).splitlines()[0]}
    skip = 2 if spec["steps"] >= 4 else 0
    targets = [t for ts, _ in trainer.forced_log for t in ts]
    realised = [n for _, ns in trainer.forced_log for n in ns]
    result |= {
        "step_ms": timer.times,
        "times_from_step": skip,
        "phases": phase_summary(trainer.phase_events, skip_steps=skip),
        "events": trainer.phase_events,
        "trainer_metrics": batching_metrics(trainer.state.log_history),
        "lengths_match": targets == realised,
        "lengths": spread(realised) if realised else None,
    }
    return result


# --- the driver ------------------------------------------------------------------------------------------------


def build_model(folder: Path, shape: str, *, vocab: int, smoke: bool) -> Path:
    """A random-init Qwen2 of ``shape`` with the tiny offline tokenizer, saved in ``folder`` (bf16 on a GPU)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from proctor.client.tiny import build_tiny_model

    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(folder.parent / "tiny-tokenizer"))
    if len(tokenizer) > vocab:
        raise ValueError(f"the model's vocabulary ({vocab}) must cover the tokenizer's {len(tokenizer)} ids")
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(
        vocab_size=vocab,
        **SHAPES[shape],
        max_position_embeddings=32_768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in bf16: half the host memory, twice as fast
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    return folder


def _key(result: dict[str, Any]) -> tuple[str, str, str]:
    return (result["shape"], result["attn"], result["variant"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.cpu_smoke
    shapes = ["smoke"] if smoke else args.shapes
    budgets = SMOKE["budgets"] if smoke else args.budgets
    prompts = SMOKE["prompts"] if smoke else args.prompts
    probe = SMOKE["probe_prompts"] if smoke else args.probe_prompts
    max_len = SMOKE["max_len"] if smoke else args.max_completion_length
    vocab = SMOKE["vocab"] if smoke else VOCAB
    payload: dict[str, Any] = {"results": []}
    if args.resume and args.out.exists():
        payload = json.loads(args.out.read_text())
    done = {_key(r) for r in payload["results"] if r.get("status") in ("ok", "oom")}
    payload["results"] = [r for r in payload["results"] if _key(r) in done]
    payload["config"] = {
        "generations": GENERATIONS,
        "budgets": budgets,
        "steps": args.steps,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "lengths": long_tail(prompts * GENERATIONS, max_len),
    }
    with tempfile.TemporaryDirectory(prefix="proctor-grpo-gpu-", dir=args.workdir) as tmp:
        for shape in shapes:
            model_dir: Path | None = None
            for attn in args.attn:
                for v in variants(budgets, prompts, probe):
                    if (shape, attn, v["variant"]) in done or (args.variants and v["variant"] not in args.variants):
                        continue
                    if model_dir is None:
                        print(f"building the {shape} model …", flush=True)
                        model_dir = build_model(Path(tmp) / shape, shape, vocab=vocab, smoke=smoke)
                    spec = {
                        **v,
                        "shape": shape,
                        "attn": attn,
                        "model": str(model_dir),
                        "workdir": tmp,
                        "max_len": max_len,
                        "steps": args.steps,
                        "smoke": smoke,
                        "round": SMOKE["round"] if smoke else 64,
                        "gradient_checkpointing": not args.no_gradient_checkpointing,
                    }
                    print(f"{shape} {attn} {v['variant']} …", flush=True)
                    result = _run_child(spec, Path(tmp), args.variant_timeout)
                    payload["results"].append(result)
                    payload["device"] = payload.get("device") or result.get("device")
                    args.out.write_text(json.dumps(payload, indent=1))
                    print(f"  {result['status']}{'' if not result.get('oom_phase') else ' in ' + result['oom_phase']}")
    return payload


def _run_child(spec: dict[str, Any], tmp: Path, timeout: float | None) -> dict[str, Any]:
    spec_file, out = tmp / "spec.json", tmp / "result.json"
    spec_file.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.grpo_gpu", "--child", str(spec_file), "--out", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    head = {k: spec[k] for k in ("shape", "attn", "variant", "prompts", "max_len", "steps")}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**head, "status": "timeout", "error": f"over {timeout} s"}
    if done.returncode != 0 or not out.exists():
        text = done.stderr or done.stdout
        # A traceback's cause is at its head and its error at its tail; a long one keeps both.
        error = text if len(text) <= 6000 else text[:3000] + "\n…\n" + text[-3000:]
        print(error, file=sys.stderr)
        return {**head, "status": "error", "error": error}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _gib(mib: float | None) -> str:
    return "–" if mib is None else f"{mib / 1024:.1f}"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def table(payload: dict[str, Any]) -> str:
    """One markdown table per (shape, attention implementation)."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in payload["results"]:
        groups.setdefault((r["shape"], r["attn"]), []).append(r)
    for (shape, attn), results in groups.items():
        out += [
            f"\n{shape} shape, {attn}:\n",
            "| variant | rows | status | resident GiB | generation peak GiB | generation tok/s | old/ref peak GiB | "
            "old/ref tok/s | old/ref forwards | old/ref computed ÷ real | train peak GiB | train tok/s | "
            "train forwards | train computed ÷ real |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in results:
            ph = r.get("phases") or {}
            gen, train = ph.get("generation", {}), ph.get("train", {})
            logps = [ph[k] for k in ("old", "ref") if k in ph]
            lp_peak = max((p["peak_mib"] for p in logps if p["peak_mib"] is not None), default=None)
            lp_ms = sum(p["ms_total"] for p in logps)
            lp_rate = sum(p["tokens"] for p in logps) / (lp_ms / 1e3) if lp_ms else None
            lp_fwd = statistics.fmean(p["forwards_per_call"] for p in logps) if logps else None
            lp_pad = statistics.fmean(p["padding"] for p in logps if p["padding"]) if logps else None
            status = r["status"] + (f" ({r['oom_phase']})" if r.get("oom_phase") else "")

            def num(value: float | None, fmt: str = ".1f") -> str:
                return "–" if value is None else format(value, fmt)

            out.append(
                f"| {r['variant']} | {r.get('rows', '')} | {status} | {_gib(train.get('base_mib'))} | "
                f"{_gib(gen.get('peak_mib'))} | {_rate(gen.get('tokens_per_s'))} | {_gib(lp_peak)} | "
                f"{_rate(lp_rate)} | {num(lp_fwd)} | {num(lp_pad, '.2f')} | {_gib(train.get('peak_mib'))} | "
                f"{_rate(train.get('tokens_per_s'))} | {num(train.get('forwards_per_call'))} | "
                f"{num(train.get('padding'), '.2f')} |"
            )
    return "\n".join(out)


def headline(payload: dict[str, Any]) -> str:
    lengths = payload["config"]["lengths"]
    from bench.grpo_step import spread

    s = spread(lengths)
    return (
        f"GRPO per phase on {payload.get('device')}: {len(lengths)} rows ({len(lengths) // GENERATIONS} prompts × "
        f"{GENERATIONS}), completions forced to min {s['min']}, median {s['median']:g}, p90 {s['p90']}, max "
        f"{s['max']} tokens; beta 0.04, num_iterations 2, {payload['config']['steps']} steps, gradient checkpointing "
        f"{'on' if payload['config']['gradient_checkpointing'] else 'off'}; budgets {payload['config']['budgets']}"
    )


def _csv(kind: type[Any]) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grpo_gpu", description=DESCRIPTION)
    parser.add_argument("--out", type=Path, required=True, help="the JSON of results (rewritten after each variant)")
    parser.add_argument("--shapes", type=_csv(str), default=["0.5b", "1.5b"], help="0.5b, 1.5b (comma-separated)")
    parser.add_argument("--budgets", type=_csv(int), default=[16384, 32768], help="tokens per packed micro-batch")
    parser.add_argument("--attn", type=_csv(str), default=None, help="default: sdpa, and flash_attention_2 if found")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (× 8 completions)")
    parser.add_argument("--probe-prompts", type=int, default=16, help="prompts per step of the out-of-memory probe")
    parser.add_argument("--max-completion-length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per variant (2 per generation)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--variants", type=_csv(str), default=None, help="only these (e.g. 'stock,dynamic 16384'); default: all"
    )
    parser.add_argument("--variant-timeout", type=float, default=None, help="seconds before a variant is stopped")
    parser.add_argument("--resume", action="store_true", help="keep the finished variants already in --out")
    parser.add_argument("--workdir", type=Path, default=None, help="where models are built (default: the temp dir)")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the code path")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child.read_text())
        try:
            result = run_variant(spec)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        args.out.write_text(json.dumps(result))
        return
    unknown = set(args.shapes) - {"0.5b", "1.5b"}
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}: choose from 0.5b, 1.5b")
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit(
            "bench.grpo_gpu: no CUDA device (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch, "
            "or pass --cpu-smoke to check the code path on the CPU."
        )
    if args.attn is None:
        from transformers.utils.import_utils import is_flash_attn_2_available

        args.attn = ["sdpa"] + (["flash_attention_2"] if not args.cpu_smoke and is_flash_attn_2_available() else [])
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    payload = run(args)
    print(headline(payload))
    print(table(payload))
    lengths_ok = all(r.get("lengths_match", True) for r in payload["results"])
    print(
        "realised completion lengths equal the forced ones in every variant"
        if lengths_ok
        else "WARNING: some completions did not end at their forced length"
    )


if __name__ == "__main__":
    main()
