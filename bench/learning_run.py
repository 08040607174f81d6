"""A real GRPO run that moves: the tiny model learns a format reward, and the per-record statistics and the live
page follow it.

Each prompt asks for one word ("Say the word plus (2)."), and a completion earns 1 when it contains that word
(the ``regex`` grader with ``from_answer``). The untrained tiny model says a given word now and then, more
often for some words than others, so each record has its own pass rate, and GRPO can raise it. The same run
is made with the ``uniform`` sampler and with ``learnability``, over the same seed; the table reads the
dataserver's own ``/dashboard`` after each: the mean reward and the share of zero-variance groups over the
first and last windows of iterations, and how many records the posterior puts at p̂ ≥ 0.5 at the end.

``--screenshot FILE`` saves the live page of the learnability run (needs Chromium).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.client.training.command import build_parser, train

__all__ = ["main"]

WORDS = "what is the answer sum of plus minus times add one two three four five six seven eight nine ten".split()
COPIES = 3  # records per word, told apart by a number in the prompt
WINDOW = 40


def write_curriculum(folder: Path, sampler: str, steps: int) -> Path:
    rows = [{"prompt": f"Say the word {w} ({i}).", "answer": w} for i in range(COPIES) for w in WORDS]
    (folder / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "name": "say_the_word",
        "seed": 1,
        "sources": {"words": {"path": "words.jsonl", "graders": [{"name": "regex", "params": {"from_answer": True}}]}},
        "stages": [{"name": "learn", "until_step": steps, "mix": [{"source": "words"}], "sampler": {"kind": sampler}}],
    }
    path = folder / f"{sampler}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def window(points: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Mean reward (weighted by completions) and zero-variance share of the groups, over ``points``."""
    graded = sum(p["graded"] for p in points)
    reward = sum((p["mean_reward"] or 0.0) * p["graded"] for p in points) / max(graded, 1)
    groups = sum(p["groups"] for p in points)
    return reward, sum(p["zero_variance_groups"] for p in points) / max(groups, 1)


def run(sampler: str, steps: int, folder: Path, screenshot: Path | None) -> dict[str, Any]:
    curriculum = write_curriculum(folder, sampler, steps)
    with ServerProcess(
        [str(curriculum), "--database-url", ":memory:", "--grader-workers", "1"], log=folder / "server.log"
    ) as server:
        args = build_parser().parse_args(
            [
                "--server", server.url,
                "--max-steps", str(steps),
                "--num-generations", "8",
                "--per-device-train-batch-size", "32",
                "--learning-rate", "1e-3",
                "--tiny-dir", str(Path(".proctor/tiny-model").resolve()),
                "--output-dir", str(folder / f"run-{sampler}"),
            ]
        )  # fmt: skip
        started = time.perf_counter()
        train(args)
        seconds = time.perf_counter() - started
        board = httpx.get(f"{server.url}/dashboard", timeout=30).json()
        if screenshot is not None:  # needs Chromium
            script = Path(__file__).resolve().parent.parent / "docs" / "screenshot.py"
            subprocess.run([sys.executable, str(script), str(screenshot), "--url", f"{server.url}/"], check=True)
    points = board["iterations"]
    [histogram] = board["pass_rates"]
    first, last = window(points[:WINDOW]), window(points[-WINDOW:])
    return {
        "sampler": sampler,
        "steps": steps,
        "seconds": seconds,
        "reward_first": first[0],
        "reward_last": last[0],
        "zero_variance_first": first[1],
        "zero_variance_last": last[1],
        "records": histogram["records"],
        "records_above_half": sum(histogram["bins"][5:]),
        "bins": histogram["bins"],
    }


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench learning_run", description=__doc__)
    parser.add_argument("--steps", type=int, default=240, help="GRPO steps per run (default 240)")
    parser.add_argument("--screenshot", type=Path, help="save the live page of the learnability run here")
    args = parser.parse_args(list(argv))
    rows = []
    with tempfile.TemporaryDirectory(prefix="proctor-learning-") as tmp:
        for sampler in ("uniform", "learnability"):
            folder = Path(tmp) / sampler
            folder.mkdir()
            shot = args.screenshot if sampler == "learnability" else None
            rows.append(run(sampler, args.steps, folder, shot))
    save("learning_run", rows)
    print(
        f"\nA real run: the tiny model, GRPO on 'say the word' ({len(WORDS) * COPIES} records, 4 prompts × 8 "
        f"completions per step, {args.steps} steps, lr 1e-3); first and last {WINDOW} iterations, from /dashboard\n"
    )
    print("| sampler | mean reward, first → last | zero-variance groups, first → last | records at p̂ ≥ 0.5 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['sampler']} | {r['reward_first']:.3f} → {r['reward_last']:.3f} "
            f"| {r['zero_variance_first']:.0%} → {r['zero_variance_last']:.0%} "
            f"| {r['records_above_half']} of {r['records']} |"
        )
    for r in rows:
        print(f"pass-rate histogram at the end, {r['sampler']}: {r['bins']}")


if __name__ == "__main__":
    main(sys.argv[1:])
