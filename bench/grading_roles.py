"""Grading as a role of the experience store, with a grader that takes 50 ms per completion (an LLM judge or a
code sandbox stands behind such a number), side by side in one run:

- **overlap**: the tiny model's GRPO step with a reference model (``beta > 0``) under ``ProctorGRPOTrainer``,
  its rewards through the store (completions posted as generation ends, graded while TRL computes the
  log-prob passes) against through ``/grade`` (posted when TRL asks for the rewards, answered when graded);
- **scale-out**: completions graded per second by the server's own pool of grader processes, and by 1, 2
  and 4 ``proctor grade-worker`` processes (each with the same number of grader processes) serving a
  server that has none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


from bench._load import dispatch_requests
from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.client import ExperienceClient

GRADER_MS = 50
PROCESSES = 2  # grader processes of the server's pool, and of each grade-worker
GRADERS = f"""
import time


def judge(sample):
    time.sleep({GRADER_MS / 1000})
    return float(len(sample.completion) % 3 == 0)
"""
CURRICULUM = """
name: judged
seed: 11
sources:
  add: {kind: arithmetic, graders: [judge]}
graders:
  judge: {python: ./graders.py:judge}
stages:
  - {name: only, until_step: 100000, mix: [{source: add}]}
"""

# Scale-out load: steps of 16 prompts × 4 completions, all posted at once.
LOAD_STEPS, LOAD_SLOTS, LOAD_GROUP = 8, 16, 4


def _curriculum(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graders.py").write_text(GRADERS)
    (folder / "judged.yaml").write_text(CURRICULUM)
    return folder / "judged.yaml"


# --- scale-out --------------------------------------------------------------------------------------------


def _graded_per_s(url: str, first_step: int) -> float:
    """Post LOAD_STEPS steps' completions and time until the grader role has graded them all."""
    steps = range(first_step, first_step + LOAD_STEPS)
    rows = [(s, k) for s in range(LOAD_SLOTS) for k in range(LOAD_GROUP)]
    with ExperienceClient(url) as experience:
        for step in steps:
            experience.client.sample(step, LOAD_SLOTS)
        t0 = time.perf_counter()
        for step in steps:
            experience.open(step, slots=LOAD_SLOTS, group_size=LOAD_GROUP)
            texts = [f"step {step} completion {n}" for n in range(len(rows))]
            experience.put(step, rows, {"completion": texts, "completion_tokens": [None] * len(rows)})
        for step in steps:
            while not experience.all_consumed("grader", step):
                time.sleep(0.01)
        elapsed = time.perf_counter() - t0
    return LOAD_STEPS * len(rows) / elapsed


def scale_out(tmp: Path, curriculum: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    keep = {"PROCTOR_EXPERIENCE_KEEP_ITERATIONS": str(LOAD_STEPS)}
    local = ServerProcess(
        [str(curriculum), "--database-url", str(tmp / "local.db"), "--grader-workers", str(PROCESSES)],
        log=tmp / "local.log",
        env=keep,
    )
    with local:
        results.append({"graders": f"the server's pool ({PROCESSES} processes)", "per_s": _graded_per_s(local.url, 0)})
    for count in (1, 2, 4):
        server = ServerProcess(
            [str(curriculum), "--database-url", str(tmp / f"remote-{count}.db"), "--grader-workers", "0"],
            log=tmp / f"remote-{count}.log",
            env=keep,
        )
        with server:
            cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", server.url]
            cmd += ["--workers", str(PROCESSES), "--rows-per-dispatch", "16", "--log-level", "warning"]
            workers = [
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)
            ]
            try:
                # Each worker has asked for work once its grader processes are up.
                deadline = time.monotonic() + 60
                while dispatch_requests(server.url) < count and time.monotonic() < deadline:
                    time.sleep(0.05)
                per_s = _graded_per_s(server.url, 0)
            finally:
                for w in workers:
                    w.terminate()
                for w in workers:
                    w.wait(timeout=30)
            label = f"{count} grade-worker{'s' if count > 1 else ''} ({count * PROCESSES} processes)"
            results.append({"graders": label, "per_s": per_s})
    return results


# --- overlap ----------------------------------------------------------------------------------------------


def overlap(tmp: Path, curriculum: Path, steps: int, rounds: int) -> list[dict[str, Any]]:
    from bench._grpo_run import train_steps  # these two need the `train` extra
    from proctor.client.tiny import build_tiny_model

    model = build_tiny_model(tmp / "tiny")
    results: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {"store": [], "grade": []}
    for n in range(rounds):
        for through in ("grade", "store"):
            # A fresh server (state) per run: a step served before would be graded already.
            name = f"overlap-{n}-{through}"
            server = ServerProcess(
                [str(curriculum), "--database-url", str(tmp / f"{name}.db"), "--grader-workers", str(PROCESSES)],
                log=tmp / f"{name}.log",
            )
            with server:
                times[through] += train_steps(server.url, model, tmp / name, steps, through)
    for through, label in (("grade", "through /grade (synchronous)"), ("store", "through the store (overlapped)")):
        results.append({"path": label, "step_ms": statistics.median(times[through]), "steps": len(times[through])})
    return results


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench grading_roles")
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per overlap run (the first 3 are warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="overlap runs of each path, alternating")
    parser.add_argument("--skip-overlap", action="store_true", help="only the scale-out part (no torch needed)")
    args = parser.parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="proctor-bench-") as tmp_name:
        tmp = Path(tmp_name)
        curriculum = _curriculum(tmp / "judged")
        out: dict[str, Any] = {"grader_ms": GRADER_MS, "processes": PROCESSES, "cpus": os.cpu_count()}
        if not args.skip_overlap:
            out["overlap"] = overlap(tmp, curriculum, args.steps, args.rounds)
        out["scale_out"] = scale_out(tmp, curriculum)
    save("grading_roles", out)
    if "overlap" in out:
        print(f"GRPO step with beta > 0 and a {GRADER_MS} ms/completion grader (tiny model, {os.cpu_count()} CPUs)")
        print("| rewards | step ms (median) | steps |\n|---|---:|---:|")
        for r in out["overlap"]:
            print(f"| {r['path']} | {r['step_ms']:.0f} | {r['steps']} |")
        print()
    total = LOAD_STEPS * LOAD_SLOTS * LOAD_GROUP
    print(f"Completions graded per second, {GRADER_MS} ms each, {total} posted at once ({os.cpu_count()} CPUs)")
    print("| grader role | completions/s |\n|---|---:|")
    for r in out["scale_out"]:
        print(f"| {r['graders']} | {r['per_s']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
