"""A GRPO step on the CPU: stock ``GRPOTrainer`` against ``ProctorGRPOTrainer`` with chunked passes, with the
log-prob passes packed by token budget, and with the training pass packed too, side by side in one run.

Variants:

- ``stock``: TRL's ``GRPOTrainer``; every pass is one forward over all 32 rows (8 prompts × 4 completions, one
  micro-step per generation), padded to the longest.
- ``chunked``: generation and the old-policy and reference passes in chunks of 8 rows.
- ``dynamic (infer)``: the old-policy and reference passes packed into micro-batches of at most 1,024 tokens
  (``use_dynamic_batching_in_infer``, lengths rounded to 8; padding-free where the model allows it).
- ``dynamic (infer+train)``: the training pass packed as well, forward and backward per micro-batch
  (``use_dynamic_batching_in_train``).

Each variant trains in a fresh process (peak memory is a per-process high-water mark, so variants cannot
share one), and the variants alternate over rounds so that drifts of the machine hit them alike. Each process
runs torch on one thread: with two OpenMP threads on this 2-core machine, any other load on it stalled their
barriers and made steps several times slower and erratic (a decode step 103 ms instead of 13). The model is
built from a config (4 layers, hidden 256) with the offline tiny tokenizer; the run has a reference model
(beta > 0) and an old-policy pass (num_iterations = 2), so all three passes the trainer batches run. With
num_iterations = 2 a generation serves two optimizer steps, a slow one (generation, old and reference passes,
training) and a fast one (training only); a step's time is the median over those pairs, halved.

Completion lengths are controlled, not left to the random model: a logits processor suppresses EOS before
each row's target length and forces it there (:class:`ForcedLengths`, mixed into both trainers so that every
variant sees the same lengths). The targets are a fixed long-tailed multiset (:func:`long_tail_lengths`:
7 rows in 8 between 8 and 24 tokens, 1 in 8 near ``max_completion_length``), dealt to the rows of each
generation in an order seeded by the generation's index, so every variant gets the same length at the same
row of the same step. The run checks that the realised lengths equal the targets and prints their spread.
That long tail is where packing pays: a padded pass computes every row at the longest row's length.

Per phase (generation, old/ref log-prob passes, training forward+backward) the run also records wall time,
real tokens and the model forwards with their padded shapes (:class:`PhaseTimes`), which give the micro-batch
counts and the padding (computed ÷ real tokens) of each pass for every variant, stock included; the table
gives the medians of those phases, and the peak RSS of each variant's process. The same machinery measures
the GPU version, with models of Qwen2.5-0.5B and 1.5B shapes, per phase: ``bench/grpo_gpu.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from trl import GRPOTrainer  # type: ignore[attr-defined]

from bench._results import save

__all__ = ["ForceLengths", "ForcedLengths", "PhaseTimes", "bench_trainer", "long_tail_lengths", "spread"]

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "chunked", "dynamic (infer)", "dynamic (infer+train)")
PROMPTS, GENERATIONS = 8, 4  # 32 rows per step
MAX_COMPLETION = 128
SHORT = (8, 24)
BUDGET = 1024  # tokens per packed micro-batch (rows × padded width)
STEPS, WARMUP, ROUNDS = 8, 2, 2
THREADS = 1  # torch threads per variant process (see the module's docstring)


# --- controlled completion lengths ------------------------------------------------------------------------------


def long_tail_lengths(
    rows: int, max_len: int, *, short: tuple[int, int], long_share: float = 1 / 8, seed: int = 0
) -> list[int]:
    """A fixed multiset of ``rows`` completion lengths (EOS included), sorted: ``long_share`` of the rows (at least
    one) between 85 % of ``max_len`` and ``max_len`` (one of them exactly ``max_len``), the others log-uniform
    over ``short``."""
    rng = random.Random(seed)
    n_long = max(1, round(rows * long_share))
    low = min(max_len, max(short[1] + 1, math.ceil(0.85 * max_len)))
    longs = [max_len] + [rng.randint(low, max_len) for _ in range(n_long - 1)]
    lo, hi = math.log(short[0]), math.log(short[1])
    shorts = [min(short[1], max(short[0], round(math.exp(rng.uniform(lo, hi))))) for _ in range(rows - n_long)]
    return sorted(shorts + longs)


def deal(lengths: Sequence[int], rows: int, generation: int, seed: int = 0) -> list[int]:
    """The target length of each of ``rows`` rows of the ``generation``-th generation: ``lengths`` (cycled if the
    generation has more rows) in an order drawn from ``(seed, generation)`` alone."""
    targets = [lengths[i % len(lengths)] for i in range(rows)]
    random.Random(seed * 1_000_003 + generation).shuffle(targets)
    return targets


def spread(values: Sequence[int]) -> dict[str, float]:
    """min / median / p90 / max of ``values``."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"min": ordered[0], "median": statistics.median(ordered), "p90": p90, "max": ordered[-1]}


class ForceLengths(LogitsProcessor):
    """Ends row ``i`` of a ``generate`` call at exactly ``targets[i]`` completion tokens, EOS included: EOS is
    suppressed before that position and is the only choice at it. Token ids at or above ``vocab_limit`` (a model
    vocabulary larger than its tokenizer's) are never sampled."""

    def __init__(self, targets: Sequence[int], prompt_width: int, eos_ids: Sequence[int], vocab_limit: int | None):
        self.last = torch.tensor(targets) - 1  # the position of each row's EOS within its completion
        self.prompt_width = prompt_width
        self.eos_ids = list(eos_ids)
        self.vocab_limit = vocab_limit
        self._masks: tuple[torch.Tensor, ...] | None = None  # built once on the scores' device

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self._masks is None or self._masks[0].device != scores.device:
            vocab, device = scores.size(1), scores.device
            is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
            is_eos[self.eos_ids] = True
            banned = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self.vocab_limit is not None:
                banned[self.vocab_limit :] = True
            forced = torch.full((1, vocab), -math.inf, dtype=scores.dtype, device=device)
            forced[0, self.eos_ids[0]] = 0.0
            self._masks = (self.last.to(device), is_eos, banned, forced)
        last, is_eos, banned, forced = self._masks
        position = input_ids.size(1) - self.prompt_width  # of the token being chosen, in the completion
        scores = scores.masked_fill(banned[None, :] | (last.gt(position)[:, None] & is_eos[None, :]), -math.inf)
        return torch.where(last.eq(position)[:, None], forced, scores)


class ForcedLengths(GRPOTrainer):
    """Mixed in before a trainer class (see :func:`bench_trainer`): each generation's completions get the lengths
    :func:`deal` assigns. The model's ``generate`` is wrapped for the duration of ``_generate_single_turn`` so that
    it receives a :class:`ForceLengths`; a trainer that generates in chunks calls it once per chunk, and each call
    takes the next rows' targets. ``forced_log`` keeps (targets, realised lengths) per generation."""

    def __init__(
        self, *args: Any, forced_lengths: Sequence[int], vocab_limit: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.forced_lengths = list(forced_lengths)
        self.forced_vocab_limit = vocab_limit
        self.forced_log: list[tuple[list[int], list[int]]] = []

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: Any,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], Any]:
        targets = deal(self.forced_lengths, len(prompt_ids), generation=len(self.forced_log))
        pending = list(targets)
        model = self.accelerator.unwrap_model(self.model_wrapped)
        own = model.__dict__.get("generate")
        original = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            input_ids = kwargs["input_ids"]
            rows = input_ids.size(0)
            mine = pending[:rows]
            del pending[:rows]
            force = ForceLengths(mine, input_ids.size(1), self.eos_token_ids, self.forced_vocab_limit)
            return original(*args, logits_processor=LogitsProcessorList([force]), **kwargs)

        model.generate = generate
        parent: Any = super()  # TRL's methods are untyped
        try:
            completion_ids, logprobs = parent._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            if own is None:
                del model.generate
            else:
                model.generate = own
        self.forced_log.append((targets, [len(c) for c in completion_ids]))
        return completion_ids, logprobs


# --- per-phase wall time, tokens, forwards and GPU memory ----------------------------------------------------


class PhaseTimes(GRPOTrainer):
    """Mixed in before :class:`ForcedLengths`: one event per phase in ``phase_events``.

    Phases: ``generation`` (each ``_generate_single_turn``, chunks included), ``old`` and ``ref`` (the no-grad
    calls of ``_get_per_token_logps_and_entropies``: the log-prob passes; the reference one is the call on
    ``ref_model``), and ``train`` (the rest of ``training_step`` once ``_prepare_inputs`` has returned: the
    training pass's forward, loss and backward, whether the trainer runs them whole or per micro-batch; the
    optimizer step is outside). Each event has wall milliseconds (after ``torch.cuda.synchronize`` on a GPU),
    real tokens (completion tokens for generation; prompt + completion tokens for the others), and for the
    forward phases the number of model forwards and the tokens they computed (rows × width, padding included),
    counted by a forward pre-hook on the policy and reference models, so stock TRL is measured like the
    others. On a GPU, ``peak_mib`` is ``torch.cuda.max_memory_allocated`` over the phase (peak statistics reset
    at its start) and ``base_mib`` the memory allocated when it began. ``current_phase`` names the phase in
    progress (``rollout`` for the rest of ``_prepare_inputs``: rewards, advantages), so that an out-of-memory
    error can be placed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phase_events: list[dict[str, Any]] = []
        self.current_phase: str | None = None
        self._cuda = self.accelerator.device.type == "cuda"
        self._forwards: list[int] = []  # tokens computed by each forward of the phase in progress
        self._train_event: dict[str, Any] | None = None
        models = [m for m in (self.model, self.ref_model) if m is not None]
        padding_free = getattr(self, "_padding_free", None)
        if callable(padding_free):
            # ProctorGRPOTrainer checks each model once, with three tiny forwards, before its first packed pass:
            # done here, that check is not counted as a phase's forwards.
            for model in models:
                padding_free(model)
        for model in models:
            model.register_forward_pre_hook(self._count_forward, with_kwargs=True)

    def _count_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.current_phase in ("old", "ref", "train"):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self._forwards.append(int(ids.numel()))

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _begin(self, phase: str) -> dict[str, Any]:
        self._sync()
        event: dict[str, Any] = {"step": self.state.global_step, "phase": phase}
        if self._cuda:
            event["base_mib"] = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        event["_outer"] = self.current_phase  # generation and the log-prob passes run inside the rollout
        self.current_phase = phase
        self._forwards = []
        event["_t0"] = time.perf_counter()
        return event

    def _end(self, event: dict[str, Any], tokens: int) -> None:
        self._sync()
        event["ms"] = (time.perf_counter() - event.pop("_t0")) * 1e3
        event["tokens"] = tokens
        event["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if self._cuda else None
        if event["phase"] != "generation":
            event["forwards"] = len(self._forwards)
            event["computed_tokens"] = sum(self._forwards)
        self.current_phase = event.pop("_outer")
        self.phase_events.append(event)

    @contextmanager
    def _phase(self, phase: str, tokens: Callable[[Any], int], box: list[Any]) -> Iterator[None]:
        # No try/finally: after an exception (out of memory) current_phase still names the phase.
        event = self._begin(phase)
        yield
        self._end(event, tokens(box[0]))

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: Any,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], Any]:
        box: list[Any] = []
        parent: Any = super()  # TRL's methods are untyped
        with self._phase("generation", lambda out: sum(len(c) for c in out[0]), box):
            box.append(
                parent._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            )
        self.phase_events[-1]["prompt_tokens"] = sum(len(p) for p in prompt_ids)
        self.phase_events[-1]["rows"] = len(prompt_ids)
        result: tuple[list[list[int]], Any] = box[0]
        return result

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if torch.is_grad_enabled():  # the training pass: timed as part of ``train``
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        phase = "ref" if self.ref_model is not None and model is self.ref_model else "old"
        box: list[Any] = []
        with self._phase(phase, lambda _: int(attention_mask.sum()), box):
            box.append(
                super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
                )
            )
        self.phase_events[-1]["rows"] = int(input_ids.size(0))
        return box[0]

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        self.current_phase = "rollout"  # generation, rewards, old/ref passes (or a buffered batch)
        inputs = super()._prepare_inputs(generation_batch)
        self.current_phase = None
        model: Any = self.model
        if model.training:
            self._train_event = self._begin("train")
            self._train_event["rows"] = int(inputs["completion_mask"].size(0))
            self._train_event["_tokens"] = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        return inputs

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        parent: Any = super()  # TRL's methods are untyped
        out = parent.training_step(model, inputs, num_items_in_batch)
        event, self._train_event = self._train_event, None
        if event is not None:
            self._end(event, event.pop("_tokens"))
        return out


def bench_trainer(base: type[Any]) -> type[Any]:
    """``base`` (``GRPOTrainer`` or a subclass) with :class:`PhaseTimes` and :class:`ForcedLengths` mixed in.
    Its constructor takes ``forced_lengths`` (and optionally ``vocab_limit``) on top of ``base``'s."""
    return type(f"Bench{base.__name__}", (PhaseTimes, ForcedLengths, base), {})


def phase_summary(events: Sequence[dict[str, Any]], skip_steps: int = 0) -> dict[str, dict[str, Any]]:
    """Per phase: events, wall ms (total and median), real and computed tokens, forwards, padding (computed ÷
    real), tokens/s, peak and base GPU MiB (maxima over the events; None on the CPU). Events of optimizer steps
    before ``skip_steps`` are left out of the times (warm-up), not of the peaks."""
    out: dict[str, dict[str, Any]] = {}
    for phase in ("generation", "old", "ref", "train"):
        every = [e for e in events if e["phase"] == phase]
        if not every:
            continue
        timed = [e for e in every if e["step"] >= skip_steps] or every
        ms = sum(e["ms"] for e in timed)
        tokens = sum(e["tokens"] for e in timed)
        peaks = [e["peak_mib"] for e in every if e.get("peak_mib") is not None]
        bases = [e["base_mib"] for e in every if e.get("base_mib") is not None]
        summary: dict[str, Any] = {
            "events": len(timed),
            "ms_total": ms,
            "ms_median": statistics.median(e["ms"] for e in timed),
            "tokens": tokens,
            "tokens_per_s": tokens / (ms / 1e3) if ms else None,
            "peak_mib": max(peaks) if peaks else None,
            "base_mib": max(bases) if bases else None,
        }
        if phase != "generation":
            computed = sum(e["computed_tokens"] for e in timed)
            summary["forwards_per_call"] = sum(e["forwards"] for e in timed) / len(timed)
            summary["padding"] = computed / tokens if tokens else None
        out[phase] = summary
    return out


def batching_metrics(log_history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The trainer's own ``batching/*`` metrics (Proctor's trainer logs them), averaged over the logged steps."""
    values: dict[str, list[float]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith("batching/") and isinstance(value, int | float):
                values.setdefault(key, []).append(float(value))
    return {key: statistics.fmean(vs) for key, vs in values.items()}


# --- the CPU benchmark -------------------------------------------------------------------------------------------


def _run_variant(variant: str, model_dir: Path, out: Path) -> None:
    """Train one variant in this process and write its step times, phases and peak memory to ``out``."""
    import datasets
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig  # type: ignore[attr-defined]

    from bench._timing import StepTimes
    from proctor.client.tiny import run_defaults
    from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = "what is one two three four five add sum plus the answer of seven nine".split()
    rows = [" ".join(words[(i * 3 + j) % len(words)] for j in range(3 + (i * 7) % 23)) for i in range(256)]
    dataset = datasets.Dataset.from_dict({"prompt": rows})

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [min(1.0, len(c) / 80) for c in completions]

    common: dict[str, Any] = {
        **run_defaults(out.parent / f"run-{variant}"),
        "per_device_train_batch_size": PROMPTS * GENERATIONS,
        "num_generations": GENERATIONS,
        "max_completion_length": MAX_COMPLETION,
        "max_steps": STEPS,
        "learning_rate": 1e-5,
        "beta": 0.04,
        "num_iterations": 2,
        "gradient_accumulation_steps": 1,
    }
    knobs: dict[str, Any] = {}
    if variant == "stock":
        config: Any = GRPOConfig(**common)
        base: type[Any] = GRPOTrainer
    else:
        if variant == "chunked":
            knobs = {"rollout_micro_batch_size": 8, "ref_logps_micro_batch_size": 8, "old_logps_micro_batch_size": 8}
        else:
            knobs = {
                "use_dynamic_batching_in_infer": True,
                "max_tokens_per_microbatch_in_infer": BUDGET,
                "sequence_length_round_in_infer": 8,
            }
            if variant == "dynamic (infer+train)":
                knobs |= {
                    "use_dynamic_batching_in_train": True,
                    "max_tokens_per_microbatch_in_train": BUDGET,
                    "sequence_length_round_in_train": 8,
                }
        config = ProctorGRPOConfig(**common, **knobs)
        base = ProctorGRPOTrainer

    timer = StepTimes()
    lengths = long_tail_lengths(PROMPTS * GENERATIONS, MAX_COMPLETION, short=SHORT)
    trainer = bench_trainer(base)(
        model=str(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
        forced_lengths=lengths,
    )
    trainer.remove_callback(PrinterCallback)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.train()
    targets = [t for ts, _ in trainer.forced_log for t in ts]
    realised = [n for _, ns in trainer.forced_log for n in ns]
    result = {
        "variant": variant,
        "knobs": knobs,
        "step_ms": timer.times[WARMUP:],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_train_mib": rss_before,
        "phases": phase_summary(trainer.phase_events, skip_steps=WARMUP),
        "trainer_metrics": batching_metrics(trainer.state.log_history),
        "lengths_match": targets == realised,
        "lengths": spread(realised),
    }
    out.write_text(json.dumps(result))


def _build_model(folder: Path) -> Path:
    from proctor.client.tiny import build_tiny_model

    # about 4M parameters
    return build_tiny_model(folder / "model", hidden_size=256, layers=4, heads=8, kv_heads=4, mlp_ratio=4)


def run() -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proctor-grpo-step-") as tmp:
        model_dir = _build_model(Path(tmp))
        for round_ in range(ROUNDS):
            for i, variant in enumerate(VARIANTS):
                out = Path(tmp) / f"{i}-{round_}.json"
                cmd = [sys.executable, "-m", "bench.grpo_step", "--variant", variant, "--model", str(model_dir)]
                cmd += ["--out", str(out)]
                env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(THREADS)}
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"grpo_step: variant {variant!r} failed:\n{done.stderr[-4000:]}")
                results.append(json.loads(out.read_text()))
    return results


def _cycle_ms(step_ms: Sequence[float]) -> list[float]:
    """Generation step + reuse step, per generation cycle (num_iterations = 2; WARMUP is even, so the measured
    steps start on a generation step)."""
    return [step_ms[i] + step_ms[i + 1] for i in range(0, len(step_ms) - 1, 2)]


def table(results: list[dict[str, Any]]) -> str:
    """Step times (a generation cycle's two steps, halved), per-phase medians (one generation, the old plus the
    reference pass, one training pass), peak RSS, and each pass's forwards per call and computed ÷ real tokens."""
    lines = [
        "| variant | steps | ms/step (median) | vs stock | generation-step ms | reuse-step ms | generation ms | "
        "old+ref ms | train-pass ms | peak RSS MiB | old/ref forwards | old/ref computed ÷ real | train forwards | "
        "train computed ÷ real |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    per_step: dict[str, float] = {}
    for variant in VARIANTS:
        rs = [r for r in results if r["variant"] == variant]
        steps = [t for r in rs for t in r["step_ms"]]
        per_step[variant] = statistics.median(c for r in rs for c in _cycle_ms(r["step_ms"])) / 2
        gen_steps = [t for r in rs for t in r["step_ms"][0::2]]
        reuse_steps = [t for r in rs for t in r["step_ms"][1::2]]

        def phase(name: str, key: str, runs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(r["phases"][name][key] for r in runs if name in r["phases"]))

        logps_ms = phase("old", "ms_median") + phase("ref", "ms_median")
        logps_fwd = (phase("old", "forwards_per_call") + phase("ref", "forwards_per_call")) / 2
        logps_pad = (phase("old", "padding") + phase("ref", "padding")) / 2
        lines.append(
            f"| {variant} | {len(steps)} | {per_step[variant]:.0f} | {per_step[variant] / per_step['stock']:.2f} | "
            f"{statistics.median(gen_steps):.0f} | {statistics.median(reuse_steps):.0f} | "
            f"{phase('generation', 'ms_median'):.0f} | {logps_ms:.0f} | {phase('train', 'ms_median'):.0f} | "
            f"{max(r['peak_rss_mib'] for r in rs):.0f} | {logps_fwd:.1f} | {logps_pad:.2f} | "
            f"{phase('train', 'forwards_per_call'):.1f} | {phase('train', 'padding'):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.variant:
        _run_variant(args.variant, args.model, args.out)
        return
    results = run()
    if not all(r["lengths_match"] for r in results):
        sys.exit("grpo_step: some completions did not end at their forced length")
    lengths = results[0]["lengths"]
    print(
        f"GRPO step on the CPU: {PROMPTS * GENERATIONS} rows ({PROMPTS} prompts × {GENERATIONS}), beta 0.04, "
        f"num_iterations 2, token budget {BUDGET}; forced completion lengths min {lengths['min']}, median "
        f"{lengths['median']:g}, p90 {lengths['p90']}, max {lengths['max']} (realised = targets in every variant)"
    )
    print(table(results))
    save("grpo_step_cpu", results)


if __name__ == "__main__":
    main()
