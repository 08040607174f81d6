"""A real GRPO run through four curricula: the tiny model learns to say the word a prompt asks for, among
distractors, under a uniform mix, a ladder of staged gates, learning-progress mixing, and learning-progress
mixing with group refill; reward and held-out pass rate against steps and rollouts.

**The task**, fixed before any run: "Say the word plus, not two, minus. (4)" asks for one word of
:data:`WORDS` with ``k`` distractor words after it, ``k`` ∈ :data:`LEVELS` (one source per ``k``:
``level0``, ``level2``, ``level4``, ``level8``). A completion passes when it contains the asked-for word (the
``regex`` grader with ``from_answer``). The tiny model is randomly initialised: it says a word of its prompt
now and then, and GRPO can raise how often it says the right one. The held-out prompts are the same
form with other numbers and distractors, never served.

**The curricula**, over the same sources:

- ``uniform``: one stage, the four sources weighted alike;
- ``staged gates``: one stage per source, easiest first, each advancing once its mean reward over its last
  128 graded completions reaches 0.5 (after 10 steps at least; capped at an even share of the steps), with
  10% replay of the earlier ones;
- ``learning_progress``: one stage over the four sources with ``mixing: {kind: learning_progress}`` (its
  default parameters);
- ``learning_progress + refill``: the same stage with ``refill: {kind: zero_variance}`` (4 rounds at most, the
  default), the trainer asking for all of them (``refill_rounds=4``).

Each run: ``proctor serve`` on the curriculum (its seed the run's), ``ProctorGRPOTrainer`` through
``RemoteRLDataset`` and ``remote_reward``, 8 prompts × 8 completions a step. Every ``--eval-every`` steps the
model generates 4 completions for each held-out prompt (sampled as in training, from a fixed seed) and the
pass rate is taken over them. The training reward per step is the dataserver's own (``/dashboard``), which
counts every graded group (refill's replaced ones too); the share of zero-variance groups trained on is TRL's
``frac_reward_zero_std``. Rollouts count every completion generated, a refill's included.

Usage::

    python -m bench curriculum_run --plot docs/curriculum_run.png    # 3 seeds × 300 steps (about 35 minutes)
    python -m bench curriculum_run --quick                           # 1 seed, 6 steps: a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._results import save
from bench.learning_run import WORDS
from proctor.cli.launcher import ServerProcess

__all__ = ["CURRICULA", "LEVELS", "main"]

LEVELS = (0, 2, 4, 8)
COPIES = 3  # training records per word and level, told apart by a number in the prompt
HELD_OUT = 1  # held-out prompts per word and level
PROMPTS, GROUP = 8, 8
SAMPLES_PER_HELD_OUT = 4
CURRICULA = ("uniform", "staged gates", "learning_progress", "learning_progress + refill")
REFILL_ROUNDS = 4
GATE = {"threshold": 0.5, "window": 128, "min_steps": 10}


def prompt(word: str, distractors: Sequence[str], number: int) -> str:
    tail = f", not {', '.join(distractors)}" if distractors else ""
    return f"Say the word {word}{tail}. ({number})"


def records(level: int, numbers: range, seed_text: str) -> list[dict[str, str]]:
    rows = []
    for number in numbers:
        for w in WORDS:
            rng = random.Random(f"{seed_text}:{level}:{number}:{w}")
            others = [x for x in WORDS if x != w]
            rows.append({"prompt": prompt(w, rng.sample(others, level), number), "answer": w})
    return rows


def write_data(folder: Path) -> dict[int, list[dict[str, str]]]:
    """The training records as JSONL files in ``folder``; returns the held-out records by level."""
    held: dict[int, list[dict[str, str]]] = {}
    for level in LEVELS:
        rows = records(level, range(COPIES), "train")
        (folder / f"level{level}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        held[level] = records(level, range(100, 100 + HELD_OUT), "held-out")
    return held


def curriculum_doc(name: str, steps: int, seed: int) -> dict[str, Any]:
    grader = [{"name": "regex", "params": {"from_answer": True}}]
    sources = {f"level{k}": {"path": f"level{k}.jsonl", "graders": grader} for k in LEVELS}
    everything = [{"source": f"level{k}"} for k in LEVELS]
    if name == "uniform":
        stages = [{"name": "all", "until_step": steps, "mix": everything}]
    elif name.startswith("learning_progress"):
        mixed: dict[str, Any] = {"name": "all", "until_step": steps, "mix": everything}
        mixed["mixing"] = {"kind": "learning_progress"}
        if name.endswith("refill"):
            mixed["refill"] = {"kind": "zero_variance"}
        stages = [mixed]
    else:
        stages = []
        for n, k in enumerate(LEVELS):
            stage: dict[str, Any] = {
                "name": f"level{k}",
                "until_step": max(n + 1, (n + 1) * steps // len(LEVELS)),
                "mix": [{"source": f"level{k}"}],
            }
            if n:
                stage["replay"] = 0.1
            if n < len(LEVELS) - 1:
                stage["advance"] = dict(GATE)
            stages.append(stage)
    return {"name": "say_the_word_ladder", "seed": seed, "sources": sources, "stages": stages}


def run_one(
    name: str, seed: int, steps: int, eval_every: int, folder: Path, held: dict[int, list[dict[str, str]]]
) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
    from proctor.client.tiny import build_tiny_model
    from proctor.client.training.command import build_parser, config_from_args
    from proctor.client.training.trainer import ProctorGRPOTrainer

    path = folder / f"{name.replace(' ', '_')}-{seed}.yaml"
    path.write_text(yaml.safe_dump(curriculum_doc(name, steps, seed), sort_keys=False))
    model_dir = str(build_tiny_model(Path(".proctor/tiny-model").resolve()))
    args = build_parser().parse_args(
        [
            "--max-steps", str(steps),
            "--num-generations", str(GROUP),
            "--per-device-train-batch-size", str(PROMPTS * GROUP),
            "--learning-rate", "1e-3",
            "--seed", str(seed),
            "--output-dir", str(folder / f"out-{name.replace(' ', '_')}-{seed}"),
        ]
    )  # fmt: skip
    config = config_from_args(args, gpu=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [(level, r) for level in LEVELS for r in held[level]]
    encoded: list[list[int]] = []
    for _, r in prompts:
        chat: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, return_dict=True
        )
        encoded.append(list(chat["input_ids"]))
    curve: list[dict[str, Any]] = []
    zero_std: list[float] = []

    def evaluate(model: Any, step: int) -> None:
        state = torch.get_rng_state()
        torch.manual_seed(1234 + step)
        was_training = model.training
        model.eval()
        passed: dict[int, list[float]] = {level: [] for level in LEVELS}
        with torch.no_grad():
            width = max(map(len, encoded))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in encoded])
            mask = (ids != pad).long()
            out = model.generate(
                input_ids=ids.repeat_interleave(SAMPLES_PER_HELD_OUT, 0),
                attention_mask=mask.repeat_interleave(SAMPLES_PER_HELD_OUT, 0),
                max_new_tokens=config.max_completion_length,
                do_sample=True,
                temperature=config.temperature,
                pad_token_id=pad,
            )
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        for n, text in enumerate(texts):
            level, record = prompts[n // SAMPLES_PER_HELD_OUT]
            passed[level].append(float(record["answer"] in text))
        if was_training:
            model.train()
        torch.set_rng_state(state)
        curve.append(
            {
                "step": step,
                "held_out": statistics.fmean(x for xs in passed.values() for x in xs),
                "by_level": {str(level): statistics.fmean(xs) for level, xs in passed.items()},
            }
        )

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            evaluate(model, 0)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step % eval_every == 0:
                evaluate(model, state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "frac_reward_zero_std" in logs:
                zero_std.append(float(logs["frac_reward_zero_std"]))

    started = time.perf_counter()
    with ServerProcess(
        [str(path), "--database-url", ":memory:", "--grader-workers", "1", "--log-level", "warning"],
        log=folder / f"server-{name.replace(' ', '_')}-{seed}.log",
    ) as server:
        client = ProctorClient(server.url)
        try:
            client.wait_ready(60)
            dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
            try:
                trainer = ProctorGRPOTrainer(
                    model=model_dir,
                    reward_funcs=remote_reward(client, dataset=dataset),
                    args=config,
                    train_dataset=dataset,
                    processing_class=tokenizer,
                    callbacks=[HeldOut()],
                    refill_rounds=REFILL_ROUNDS if name.endswith("refill") else 0,
                )
                trainer.remove_callback(PrinterCallback)
                trainer.train()
            finally:
                dataset.close()
            board = httpx.get(f"{server.url}/dashboard", timeout=30).json()
        finally:
            client.close()
    rewards = {p["iteration"]: p["mean_reward"] for p in board["iterations"]}
    refilled = {p["iteration"]: p["refilled_groups"] for p in board["iterations"]}
    return {
        "curriculum": name,
        "seed": seed,
        "steps": steps,
        "rollouts_per_step": PROMPTS * GROUP,
        # Completions generated by the end of each step: the batch's, and each refilled group's again.
        "rollouts": list(itertools.accumulate(PROMPTS * GROUP + refilled.get(i, 0) * GROUP for i in range(steps))),
        "zero_std": zero_std,
        "reward": [rewards.get(i) for i in range(steps)],
        "held_out": curve,
        "transitions": [t["reason"] for t in board["transitions"]],
        "seconds": time.perf_counter() - started,
    }


def _median_curve(runs: Sequence[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """Per evaluated step: the median held-out pass rate over the runs, and its min and max."""
    out = []
    for n, point in enumerate(runs[0]["held_out"]):
        values = [r["held_out"][n]["held_out"] for r in runs]
        out.append((point["step"], statistics.median(values), min(values), max(values)))
    return out


def _smoothed(values: Sequence[float | None], window: int) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(statistics.fmean(part) if part else None)
    return out


def table(runs: Sequence[dict[str, Any]]) -> str:
    steps = runs[0]["steps"]
    marks = [p["step"] for p in runs[0]["held_out"]]
    shown = sorted({marks[0], marks[len(marks) // 3], marks[2 * len(marks) // 3], marks[-1]})
    lines = [
        "| curriculum | "
        + " | ".join(f"held-out pass rate, step {s} (median, min–max)" for s in shown)
        + f" | training reward, last {max(1, steps // 10)} steps (median) | zero-variance share trained (median)"
        " | rollouts (median) |",
        "| --- | " + " | ".join("---:" for _ in shown) + " | ---: | ---: | ---: |",
    ]
    for name in CURRICULA:
        mine = [r for r in runs if r["curriculum"] == name]
        if not mine:
            continue
        curve = {step: (med, lo, hi) for step, med, lo, hi in _median_curve(mine)}
        tail = max(1, steps // 10)
        last = [statistics.fmean(v for v in r["reward"][-tail:] if v is not None) for r in mine]
        cells = [f"{curve[s][0]:.3f} ({curve[s][1]:.3f}–{curve[s][2]:.3f})" for s in shown]
        zero = statistics.median(statistics.fmean(r["zero_std"]) if r["zero_std"] else float("nan") for r in mine)
        rollouts = statistics.median(r["rollouts"][-1] for r in mine)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {statistics.median(last):.3f} | {zero:.1%} | {rollouts:,.0f} |"
        )
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
    colours = {
        "uniform": "#6b7280",
        "staged gates": "#2563eb",
        "learning_progress": "#dc2626",
        "learning_progress + refill": "#16a34a",
    }
    for name in CURRICULA:
        mine = [r for r in runs if r["curriculum"] == name]
        if not mine:
            continue
        steps = range(1, mine[0]["steps"] + 1)
        smoothed = [_smoothed(r["reward"], 10) for r in mine]
        median = [statistics.median(v for v in col if v is not None) for col in zip(*smoothed, strict=True)]
        curve = _median_curve(mine)
        # Against rollouts: each step at the median over the seeds of the completions generated by its end.
        generated = [0.0] + [statistics.median(col) for col in zip(*(r["rollouts"] for r in mine), strict=True)]
        for column, xs in enumerate(([float(s) for s in range(len(generated))], generated)):
            x = [xs[s] for s in steps]
            axes[0][column].plot(x, median, color=colours[name], label=name)
            hx = [xs[s] for s, *_ in curve]
            axes[1][column].plot(hx, [m for _, m, _, _ in curve], color=colours[name], marker="o", ms=3, label=name)
            axes[1][column].fill_between(
                hx, [lo for *_, lo, _ in curve], [hi for *_, hi in curve], color=colours[name], alpha=0.15
            )
    axes[0][0].set_ylabel("training reward (10-step mean, median of seeds)")
    axes[1][0].set_ylabel("held-out pass rate (median, min–max)")
    axes[1][0].set_xlabel("optimizer steps")
    axes[1][1].set_xlabel("rollouts (completions generated)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="upper left")
    seeds = len({r["seed"] for r in runs})
    plural = "s" if seeds != 1 else ""
    fig.suptitle(f"The tiny model, 'say the word' among 0–8 distractors: four curricula, {seeds} seed{plural} each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench curriculum_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per curriculum (default 3)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations (default 25)")
    parser.add_argument("--plot", type=Path, help="save the curves as a PNG here")
    parser.add_argument("--quick", action="store_true", help="1 seed, 6 steps, an evaluation every 3: a smoke run")
    args = parser.parse_args(list(argv))
    if args.quick:
        args.seeds, args.steps, args.eval_every = 1, 6, 3
    if args.seeds < 1 or args.steps < len(LEVELS) or args.eval_every < 1:
        parser.error(f"need --seeds ≥ 1, --steps ≥ {len(LEVELS)}, --eval-every ≥ 1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="proctor-curriculum-run-") as tmp:
        folder = Path(tmp)
        held = write_data(folder)
        for seed in range(args.seeds):
            for name in CURRICULA:
                runs.append(run_one(name, seed, args.steps, args.eval_every, folder, held))
    save("curriculum_run", runs)
    print(
        f"\nThe tiny model through four curricula: 'say the word' among {', '.join(map(str, LEVELS))} distractors "
        f"({len(WORDS) * COPIES} records per level, {len(WORDS) * HELD_OUT} held out), {PROMPTS} prompts × {GROUP} "
        f"completions a step, {args.steps} steps, {args.seeds} seed{'s' if args.seeds != 1 else ''}\n"
    )
    print(table(runs))
    for name in CURRICULA:
        reasons = {tuple(r["transitions"]) for r in runs if r["curriculum"] == name and r["transitions"]}
        for reasons_of_run in sorted(reasons):
            print(f"{name} transitions: {'; '.join(reasons_of_run)}")
    if args.plot is not None:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main(sys.argv[1:])
