"""What the dataserver adds to a GRPO step: the tiny model trained with ``RemoteRLDataset`` + ``remote_reward``
against a real server process, and the same run with an in-memory ``datasets.Dataset`` and a local reward
that does the same grading (the same prompts, the same answers, the same ``numeric`` grader), side by side.

Runs alternate (local, remote, local, remote) so that drifts of the machine hit both alike; per-step times
exclude each run's first steps (compilation of the generation path, caches). Besides the step time, the time
inside the reward function and inside the dataset's fetches is measured directly: those are where the two
variants differ.

A third variant takes the in-memory dataset and a reward function that posts the step's completions to
``bench.bare_baseline`` (a minimal FastAPI app that grades them and keeps nothing) over one keep-alive
connection: what any reward over HTTP costs on the machine, which proctor's figures include.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import datasets
import httpx
import torch
from transformers import AutoTokenizer, PrinterCallback
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from bench._results import save
from bench._timing import StepTimes
from proctor.cli.launcher import ServerProcess
from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
from proctor.client.tiny import build_tiny_model, run_defaults
from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import numeric
from proctor.server.shipped import builtin_path
from proctor.server.sources.base import SampleId

STEPS = 30
WARMUP = 5
ROUNDS = 4
BATCH, GENERATIONS = 8, 4  # 2 prompts × 4 completions per step
LOCAL = "in-memory Dataset + local reward"
BARE = "in-memory Dataset + a reward posted to a bare server (bench.bare_baseline)"


@dataclass
class Run:
    variant: str
    added_by: str  # what the variant adds to the local one, in the table's "added by" lines
    step_ms: list[float]
    reward_ms: list[float]
    fetch_ms: list[float]


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - started) * 1e3)

    wrapper.__name__ = getattr(fn, "__name__", "reward")
    return wrapper


def _config(out: Path, steps: int, gpu: bool) -> GRPOConfig:
    return GRPOConfig(
        **run_defaults(out, gpu=gpu),
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=1e-4,
        shuffle_dataset=False,
    )


def _train(model: Path, config: GRPOConfig, dataset: datasets.Dataset, reward: Callable[..., Any]) -> list[float]:
    timer = StepTimes()
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return timer.times[WARMUP:]


def _local_dataset(client: ProctorClient, prompts_per_step: int, steps: int) -> tuple[datasets.Dataset, dict[str, str]]:
    """The prompts the server serves for the run's steps, as an in-memory dataset, with their answers."""
    curriculum = load_curriculum(builtin_path("arithmetic"))
    rows: dict[str, list[Any]] = {"prompt": [], "sample_id": []}
    answers: dict[str, str] = {}
    for step in range(steps + 2):
        for s in client.sample(step, prompts_per_step).samples:
            rows["prompt"].append(
                [{"role": "system", "content": s.system_prompt or ""}, {"role": "user", "content": s.prompt}]
            )
            rows["sample_id"].append(s.sample_id)
            sid = SampleId.parse(s.sample_id)
            answers[s.sample_id] = curriculum.sources[sid.source].record(sid.key).answer or ""
    return datasets.Dataset.from_dict(rows), answers


def _bare_reward(http: httpx.Client, key_of: dict[str, int]) -> Callable[..., list[float]]:
    """A reward function that posts the step's completions to the bare baseline's ``/grade``."""

    def bare_reward(completions: list[Any], sample_id: list[str], **_: Any) -> list[float]:
        items = [
            {"sample_id": f"rows:{key_of[sid]}", "completion": c[-1]["content"]}
            for c, sid in zip(completions, sample_id, strict=True)
        ]
        response = http.post("/grade", json={"items": items})
        response.raise_for_status()
        return [float(r["reward"]) for r in response.json()["results"]]

    return bare_reward


def _in_memory_run(
    model: Path, config: GRPOConfig, dataset: datasets.Dataset, reward: Callable[..., Any], variant: str, added_by: str
) -> Run:
    reward_ms: list[float] = []
    steps = _train(model, config, dataset, _timed(reward, reward_ms))
    return Run(variant, added_by, steps, reward_ms[WARMUP:], [0.0])


def _proctor_run(
    model: Path, config: GRPOConfig, state: Path, through: Literal["grade", "store"]
) -> tuple[Run, float | None]:
    """A run through a fresh server of its own, and, through ``/grade``, that server's mean time on one (None
    through the store). Each run has its own server (same curriculum and seed, so the same prompts): the store
    keeps the latest steps' tables, and a step a run already wrote would be another attempt of it."""
    fresh = ServerProcess(
        [str(builtin_path("arithmetic")), "--database-url", str(state), "--log-level", "warning"],
        log=state.with_suffix(".log"),
    )
    reward_ms: list[float] = []
    fetch_ms: list[float] = []
    with fresh, ProctorClient(fresh.url) as client:
        remote = RemoteRLDataset(client, config, processing_class=AutoTokenizer.from_pretrained(model))
        # The transform is the only place a step can wait for the server's prompts: time it.
        remote.set_transform(_timed(remote.fetcher, fetch_ms))
        reward = remote_reward(client, dataset=remote, through=through)
        steps = _train(model, config, remote, _timed(reward, reward_ms))
        remote.close()
        grade_ms = _server_mean_ms(fresh.url, "/grade") if through == "grade" else None
    path = "/grade" if through == "grade" else "the store"
    variant = f"RemoteRLDataset + remote_reward through {path}"
    return Run(variant, f"the dataserver, through {path}", steps, reward_ms[WARMUP:], fetch_ms), grade_ms


def run(steps_per_run: int = STEPS, rounds: int = ROUNDS, gpu: bool = False) -> tuple[list[Run], dict[str, object]]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # leave a core to the server and its graders
    runs: list[Run] = []
    grade_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="proctor-bench-") as tmp:
        folder = Path(tmp)
        model = build_tiny_model(folder / "tiny")
        config = _config(folder / "run", steps_per_run, gpu)
        server = ServerProcess(
            [str(builtin_path("arithmetic")), "--database-url", str(folder / "state.db"), "--log-level", "warning"],
            log=folder / "server.log",
        )
        with server, ProctorClient(server.url) as client:
            local_ds, answers = _local_dataset(client, BATCH // GENERATIONS, steps_per_run)

        def local_reward(completions: list[Any], sample_id: list[str], **_: Any) -> list[float]:
            # The same grading as the server's `numeric` grader, in this process.
            return [
                numeric(GradeInput(prompt="", completion=c[-1]["content"], answer=answers[sid]))
                for c, sid in zip(completions, sample_id, strict=True)
            ]

        # The bare baseline serves the same records as rows:0, rows:1, ... in the order of the local dataset.
        key_of = {sid: k for k, sid in enumerate(answers)}
        rows = folder / "rows.jsonl"
        rows.write_text("".join(json.dumps({"question": sid, "answer": a}) + "\n" for sid, a in answers.items()))
        bare = ServerProcess([str(rows)], log=folder / "bare.log", module="bench.bare_baseline", subcommand=None)
        with bare, httpx.Client(base_url=bare.url) as http:
            for n in range(rounds):
                runs.append(_in_memory_run(model, config, local_ds, local_reward, LOCAL, ""))
                bare_reward = _bare_reward(http, key_of)
                runs.append(
                    _in_memory_run(model, config, local_ds, bare_reward, BARE, "a reward over HTTP, to a bare server")
                )
                for through in ("grade", "store"):
                    proctor, ms = _proctor_run(model, config, folder / f"run-{n}-{through}.db", through)
                    runs.append(proctor)
                    if ms is not None:
                        grade_ms.append(ms)
    env: dict[str, object] = {
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch_threads": torch.get_num_threads(),
        "steps_per_run": steps_per_run,
        "warmup": WARMUP,
        "rounds": rounds,
        "completions_per_step": BATCH,
        "server_grade_ms_mean": statistics.mean(grade_ms),
    }
    return runs, env


def _server_mean_ms(url: str, route: str) -> float:
    """Mean time the server itself spent on ``route`` (from its latency histogram)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f'proctor_request_duration_seconds_{part}{{method="POST",route="{route}"}}'):
                values[part] = float(line.rsplit(" ", 1)[1])
    return 1e3 * values["sum"] / values["count"] if values.get("count") else float("nan")


def table(runs: list[Run]) -> str:
    by_variant: dict[str, list[Run]] = {}
    for r in runs:
        by_variant.setdefault(r.variant, []).append(r)
    lines = [
        "| variant | steps | step ms (median) | step ms (p90) | reward fn ms (median) | prompt fetch ms (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    medians: dict[str, float] = {}
    added_by = {r.variant: r.added_by for r in runs}
    for variant, rs in by_variant.items():
        steps = [t for r in rs for t in r.step_ms]
        rewards = [t for r in rs for t in r.reward_ms]
        fetches = [t for r in rs for t in r.fetch_ms]
        medians[variant] = statistics.median(steps)
        p90 = statistics.quantiles(steps, n=10)[-1]
        lines.append(
            f"| {variant} | {len(steps)} | {medians[variant]:.1f} | {p90:.1f} | {statistics.median(rewards):.2f} | "
            f"{statistics.median(fetches):.2f} |"
        )
    local = next(iter(medians.values()))
    for variant, remote in list(medians.items())[1:]:
        lines.append(
            f"| **added by {added_by[variant]}** | | **{remote - local:+.1f}** ({remote / local:.3f}×) | | | |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench trainer_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps a run, the first {WARMUP} left out ({STEPS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"runs of each variant, alternating ({ROUNDS})")
    parser.add_argument("--gpu", action="store_true", help="train on the CUDA device, in bf16 (default: the CPU)")
    args = parser.parse_args(list(argv))
    if args.steps <= WARMUP or args.rounds < 1:
        parser.error(f"--steps must be more than {WARMUP} and --rounds at least 1")
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device and a CUDA build of torch; this torch sees none")
    runs, env = run(args.steps, args.rounds, args.gpu)
    print(f"GRPO step, tiny model on {env['device']}, {BATCH} completions per step ({env['cpus']} CPUs)")
    print(table(runs))
    print(f"server-side time per /grade (mean, from its metrics): {env['server_grade_ms_mean']:.2f} ms")
    save("trainer_overhead", {"env": env, "runs": [asdict(r) for r in runs]})


if __name__ == "__main__":
    main(sys.argv[1:])
