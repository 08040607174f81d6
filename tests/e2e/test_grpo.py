"""Real TRL GRPO on the tiny offline model against a real dataserver: cadence, groups, grading, learning,
the curriculum, and a server killed and restarted in the middle of the run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.cli.launcher import ServerProcess
from proctor.client import ProctorClient, RemoteRLDataset
from proctor.client.rewards import RemoteReward
from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

pytestmark = pytest.mark.e2e

GENERATIONS = 4
STEPS = 4

# Rewards with spread (the completion's length), so that GRPO's advantages are not all zero and the tiny
# model's parameters move; the stage changes at iteration 2.
GRADERS = """
def length(sample):
    return min(1.0, len(sample.completion) / 40)
"""
CURRICULUM = {
    "name": "cadence",
    "seed": 1,
    "sources": {
        "easy": {"kind": "arithmetic", "graders": ["length"]},
        "hard": {"kind": "arithmetic", "digits": [2, 3], "graders": ["length"]},
    },
    "graders": {"length": {"python": "./graders.py:length"}},
    "stages": [
        {"name": "easy", "until_step": 2, "mix": [{"source": "easy"}]},
        {"name": "hard", "until_step": 50, "mix": [{"source": "hard"}]},
    ],
}


@pytest.fixture
def curriculum(tmp_path: Path) -> Path:
    folder = tmp_path / "cadence"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    path = folder / "cadence.yaml"
    path.write_text(yaml.safe_dump(CURRICULUM, sort_keys=False))
    return path


def grpo_config(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    return GRPOConfig(**grpo_values(tmp_path, **overrides))


def grpo_values(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        **run_defaults(tmp_path / "run"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,  # steps_per_generation = 2: two prompts per generation step
        "num_generations": GENERATIONS,
        "max_completion_length": 8,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "shuffle_dataset": False,
    }
    values.update(overrides)
    return values


class Recorder(RemoteReward):
    """``remote_reward`` that keeps the columns of every call, and how many completions of the step the
    experience store held when TRL asked for the rewards."""

    def __init__(self, client: ProctorClient, dataset: RemoteRLDataset, **kwargs: Any) -> None:
        super().__init__(client, dataset=dataset, **kwargs)
        self.calls: list[dict[str, Any]] = []
        self.stored_before: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
        self.calls.append({k: list(kwargs[k]) for k in ("sample_id", "slot", "completion_index", "iteration")})
        if self.through == "store":
            step = int(kwargs["iteration"][0])
            opened = {t.iteration for t in self.experience.tables()}
            self.stored_before.append(self.experience.table(step).written.get("completion", 0) if step in opened else 0)
        return super().__call__(*args, **kwargs)


def train(
    url: str,
    tiny_model: Path,
    config: GRPOConfig,
    callbacks: list[Any] | None = None,
    trainer_cls: type[GRPOTrainer] = GRPOTrainer,
    through: str = "store",
) -> dict[str, Any]:
    client = ProctorClient(url, retries=8, backoff=0.2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    reward = Recorder(client, dataset, through=through)
    trainer = trainer_cls(
        model=str(tiny_model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks or [],
    )
    assert trainer.model is not None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    dataset.close()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    client.close()
    return {
        "requested": list(dataset.requested),
        "calls": reward.calls,
        "stored_before": reward.stored_before,
        "changed": changed,
        "losses": losses,
    }


def server_metric(url: str, route: str) -> int:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'proctor_requests_total{{method="POST",route="{route}",status="200"}}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


@pytest.mark.parametrize("through", ["store", "grade"])
def test_grpo_against_the_dataserver(
    live_server: Callable[..., Any], curriculum: Path, tiny_model: Path, tmp_path: Path, through: str
) -> None:
    with live_server(curriculum=curriculum) as url:
        result = train(url, tiny_model, grpo_config(tmp_path), through=through)
        state = httpx.get(url + "/curriculum").json()
        samples = {i: httpx.post(url + "/sample", json={"iteration": i, "batch_size": 2}).json() for i in range(STEPS)}
        sample_requests, grade_requests = server_metric(url, "/sample"), server_metric(url, "/grade")
        tables = {t["iteration"]: t for t in httpx.get(url + "/experience").json()["tables"]}

    # One /sample per generation step, with iteration = that step. Steps past the last trained one were
    # fetched ahead: one by the loader's look-ahead, one more by the dataset's prefetch.
    assert result["requested"] == list(range(len(result["requested"])))
    assert STEPS <= len(result["requested"]) <= STEPS + 2
    assert sample_requests == len(result["requested"]) + STEPS  # the test's own reads above
    assert len(result["calls"]) == STEPS
    # Every requested step has its table (/sample opened it); the trained steps' completions and rewards are
    # rows of theirs, whichever way they were graded.
    assert sorted(tables) == result["requested"]
    graded = {i: t for i, t in tables.items() if "completion" in t["written"]}
    assert sorted(graded) == list(range(STEPS))
    for t in graded.values():
        columns = ("sample_id", "completion", "reward") + (("completion_ids",) if through == "store" else ())
        assert {c: t["written"][c] for c in columns} == dict.fromkeys(columns, 8)
    if through == "grade":  # one /grade per generation batch, each for its own generation step
        assert grade_requests == STEPS
        assert {t["width"] for t in graded.values()} == {GENERATIONS}
    else:
        assert grade_requests == 0
        assert {(t["slots"], t["group_size"]) for t in graded.values()} == {(2, GENERATIONS)}
    # Every completion counted once in the curriculum's statistics, whichever way it was graded.
    assert sum(stage["graded"] + stage["errors"] for stage in state["stages"]) == 8 * STEPS
    assert [c["iteration"] for c in result["calls"]] == [[i] * 8 for i in range(STEPS)]
    for i, call in enumerate(result["calls"]):
        groups = [call["sample_id"][g : g + GENERATIONS] for g in range(0, 8, GENERATIONS)]
        # The G completions of a group carry one sample_id, numbered 0..G-1, in the server's slot order.
        assert [g[0] for g in groups] == [s["sample_id"] for s in samples[i]["samples"]]
        assert all(len(set(g)) == 1 for g in groups)
        assert call["completion_index"] == list(range(GENERATIONS)) * 2
    assert result["changed"], "the model's parameters did not change"
    assert all(loss == loss for loss in result["losses"])  # finite, not NaN
    assert [(t["iteration"], t["from_stage"], t["to_stage"]) for t in state["transitions"]] == [(2, "easy", "hard")]
    assert [samples[i]["stage"] for i in range(STEPS)] == ["easy", "easy", "hard", "hard"]


class KillAndRestart(TrainerCallback):
    """After the first optimizer step, kill -9 the server and bring it back on the same port a second later."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.restarted = threading.Event()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != 1:
            return
        self.server.kill()

        def restart() -> None:
            time.sleep(1.0)
            self.server.start()
            self.restarted.set()

        threading.Thread(target=restart, daemon=True).start()


def test_training_survives_a_server_restart(
    server_process: Callable[..., ServerProcess], curriculum: Path, tiny_model: Path, tmp_path: Path
) -> None:
    server = server_process([str(curriculum), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"])
    killer = KillAndRestart(server)
    result = train(server.url, tiny_model, grpo_config(tmp_path, max_steps=6), callbacks=[killer])
    assert killer.restarted.is_set()
    assert len(result["calls"]) == 6
    # Every step trained on exactly the batch the (restarted) server holds for that iteration.
    with httpx.Client(base_url=server.url) as c:
        for i, call in enumerate(result["calls"]):
            batch = c.post("/sample", json={"iteration": i, "batch_size": 2}).json()["samples"]
            assert call["sample_id"][::GENERATIONS] == [s["sample_id"] for s in batch]
        assert c.get("/curriculum").json()["transitions"][0]["iteration"] == 2


def test_the_batching_trainer_against_the_dataserver(
    live_server: Callable[..., Any], curriculum: Path, tiny_model: Path, tmp_path: Path
) -> None:
    args = ProctorGRPOConfig(
        **grpo_values(tmp_path),
        rollout_micro_batch_size=4,
        use_dynamic_batching_in_train=True,
        max_tokens_per_microbatch_in_train=64,
    )
    with live_server(curriculum=curriculum) as url:
        result = train(url, tiny_model, args, trainer_cls=ProctorGRPOTrainer)
        state = httpx.get(url + "/curriculum").json()
    # The trainer wrote each step's completions to the store as generation ended, before TRL asked for
    # the rewards (and so before its log-prob passes).
    assert result["stored_before"] == [8] * STEPS
    assert result["requested"][:STEPS] == list(range(STEPS))
    assert [c["iteration"][0] for c in result["calls"]] == list(range(STEPS))
    assert result["changed"]
    assert [(t["iteration"], t["to_stage"]) for t in state["transitions"]] == [(2, "hard")]


@pytest.mark.parametrize("rows", [2, 5], ids=["fewer-rows-than-the-batch", "more-rows-than-the-batch"])
def test_a_source_smaller_than_a_few_batches_trains(
    live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path, rows: int
) -> None:
    # 3 prompts × 2 completions per step from a JSONL source of `rows` records: with 2 rows every step repeats
    # one; with 5, batches straddle epoch boundaries. Either way each prompt is its own slot.
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    (folder / "rows.jsonl").write_text("".join(f'{{"prompt": "Say {i}", "answer": "{i}"}}\n' for i in range(rows)))
    doc = {
        "name": "small",
        "seed": 2,
        "sources": {"rows": {"path": "rows.jsonl", "graders": ["length"]}},
        "graders": {"length": {"python": "./graders.py:length"}},
        "stages": [{"name": "only", "until_step": 100, "mix": [{"source": "rows"}]}],
    }
    (folder / "small.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    config = grpo_config(
        tmp_path, per_device_train_batch_size=6, gradient_accumulation_steps=1, num_generations=2, max_steps=8
    )
    with live_server(curriculum=folder / "small.yaml") as url:
        result = train(url, tiny_model, config)
        state = httpx.get(url + "/curriculum").json()
    assert len(result["calls"]) == 8
    for call in result["calls"]:
        assert call["slot"] == [0, 0, 1, 1, 2, 2]
        assert call["completion_index"] == [0, 1] * 3
    # A record twice in a batch only when the source has fewer records than the batch has slots.
    repeated = [c for c in result["calls"] if len(set(c["sample_id"])) < 3]
    assert (len(repeated) == 8) if rows == 2 else not repeated
    assert state["stages"][0]["graded"] == 8 * 6  # every completion of every slot graded once


@pytest.mark.parametrize("trainer_cls", [GRPOTrainer, ProctorGRPOTrainer], ids=["stock", "proctor"])
def test_a_run_resumed_in_the_middle_of_a_generation_trains_on_through_the_store(
    live_server: Callable[..., Any], curriculum: Path, tiny_model: Path, tmp_path: Path, trainer_cls: type[Any]
) -> None:
    """A checkpoint after the first of a generation's two optimizer steps: stock TRL generates that step again
    on resume, with other completions than the ones the store holds from the first run."""
    config_cls = ProctorGRPOConfig if trainer_cls is ProctorGRPOTrainer else GRPOConfig
    values = grpo_values(tmp_path, steps_per_generation=4, max_steps=3, save_steps=1, save_strategy="steps")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with live_server(curriculum=curriculum) as url:
        for resume in (None, str(tmp_path / "run" / "checkpoint-1")):
            client = ProctorClient(url, retries=8, backoff=0.2)
            config = config_cls(**{**values, "seed": 0 if resume is None else 1})
            dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
            trainer = trainer_cls(
                model=str(tiny_model),
                reward_funcs=RemoteReward(client, dataset=dataset),
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            trainer.train(resume_from_checkpoint=resume)
            assert trainer.state.global_step == 3
            dataset.close()
            client.close()
        graded = sum(s["graded"] + s["errors"] for s in httpx.get(url + "/curriculum").json()["stages"])
        loose = [t for t in httpx.get(url + "/experience").json()["tables"] if t["iteration"] < 0]
    # Both runs' completions are graded and kept: the second run's new ones of a step as loose completions.
    assert graded > 8 * 2
    assert loose or trainer_cls is ProctorGRPOTrainer
