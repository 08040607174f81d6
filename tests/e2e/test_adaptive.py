"""An adaptive curriculum served for real: each sampler's batches and each learning-progress stage's source
weights follow the grades, every rank and retry gets the same batch, and a server restarted on its state file goes
on choosing exactly as an uninterrupted one."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proctor.server.app import create_app
from proctor.server.settings import Settings
from tests.conftest import serve_in_thread

ROWS = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "level": i % 5} for i in range(40)]
DOC: dict[str, Any] = {
    "name": "adaptive",
    "seed": 3,
    "statistics": {"decay": 0.8},
    "sources": {
        "qa": {"path": "qa.jsonl", "prompt_field": "q", "answer_field": "a", "graders": ["exact_match"]},
        "add": {"kind": "arithmetic", "size": 50, "graders": ["numeric"]},
        "qa_levels": {
            "path": "qa.jsonl",
            "prompt_field": "q",
            "answer_field": "a",
            "difficulty_field": "level",
            "graders": ["exact_match"],
        },
    },
    "stages": [
        {
            "name": "learn",
            "until_step": 6,
            "mix": [{"source": "qa"}, {"source": "add"}],
            "sampler": {"kind": "learnability"},
        },
        {"name": "skip", "until_step": 12, "mix": [{"source": "qa"}], "sampler": {"kind": "skip_zero_variance"}},
        {
            "name": "target",
            "until_step": 18,
            "mix": [{"source": "qa_levels"}],
            "sampler": {"kind": "target_difficulty", "params": {"difficulty": "record"}},
        },
        {
            "name": "progress",
            "until_step": 24,
            "mix": [{"source": "qa"}, {"source": "add", "weight": 3}],
            "mixing": {"kind": "learning_progress", "params": {"window": 6, "floor": 0.2}},
        },
        {
            "name": "progress_learn",
            "until_step": 30,
            "mix": [{"source": "qa"}, {"source": "add"}],
            "sampler": {"kind": "learnability"},
            "mixing": {"kind": "learning_progress", "params": {"window": 6, "floor": 0.2}},
        },
    ],
}
BATCH = 8
GROUP = 4


@pytest.fixture
def serve(tmp_path: Path, state_target: Callable[[str], str]) -> Callable[[str], AbstractContextManager[str]]:
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "adaptive.yaml").write_text(yaml.safe_dump(DOC, sort_keys=False))

    def start(state: str) -> AbstractContextManager[str]:
        target = state_target(str(tmp_path / state))
        settings = Settings(curriculum=tmp_path / "adaptive.yaml", database_url=target, grader_workers=1)
        return serve_in_thread(create_app(settings))

    return start


def completions(iteration: int, sample: dict[str, Any]) -> list[str]:
    """Answers that are right for some prompts and wrong for others, the same on every run."""
    rng = random.Random(f"{iteration}:{sample['slot']}")
    return [rng.choice(["0", "2", "4", "6", "8"]) for _ in range(GROUP)]


def run_steps(url: str, steps: range) -> list[list[str]]:
    batches = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for iteration in steps:
            answer = client.post("/sample", json={"iteration": iteration, "batch_size": BATCH})
            assert answer.status_code == 200, answer.text
            samples = answer.json()["samples"]
            batches.append([s["sample_id"] for s in samples])
            items = [
                {"sample_id": s["sample_id"], "slot": s["slot"], "completion": text}
                for s in samples
                for text in completions(iteration, s)
            ]
            graded = client.post("/grade", json={"iteration": iteration, "items": items})
            assert graded.status_code == 200, graded.text
    return batches


def test_a_restarted_server_chooses_what_an_uninterrupted_one_chooses(
    serve: Callable[[str], AbstractContextManager[str]],
) -> None:
    with serve("straight.db") as url:
        straight = run_steps(url, range(30))
    interrupted = []
    # Restarts inside each adaptive stage.
    for steps in (range(4), range(4, 9), range(9, 14), range(14, 21), range(21, 27), range(27, 30)):
        with serve("interrupted.db") as url:
            interrupted += run_steps(url, steps)
    assert interrupted == straight


def test_every_rank_and_retry_gets_the_decided_batch(serve: Callable[[str], AbstractContextManager[str]]) -> None:
    with serve("ranks.db") as url, httpx.Client(base_url=url, timeout=60) as client:
        run_steps(url, range(3))
        whole = client.post("/sample", json={"iteration": 3, "batch_size": BATCH}).json()["samples"]
        # Grades of other iterations arriving now change the per-record state, never a decided batch.
        run_steps(url, range(4, 6))
        shares = [
            client.post("/sample", json={"iteration": 3, "batch_size": BATCH, "rank": r, "world_size": 2}).json()[
                "samples"
            ]
            for r in range(2)
        ]
        again = client.post("/sample", json={"iteration": 3, "batch_size": BATCH}).json()["samples"]
    assert shares[0] + shares[1] == whole == again


def test_the_statistics_follow_the_grades(serve: Callable[[str], AbstractContextManager[str]]) -> None:
    with serve("stats.db") as url, httpx.Client(base_url=url, timeout=60) as client:
        batches = run_steps(url, range(14))
        board = client.get("/dashboard").json()
        state = client.get("/curriculum").json()
    assert [s["sampler"] for s in state["stages"]] == [
        "learnability",
        "skip_zero_variance",
        "target_difficulty",
        "uniform",
        "learnability",
    ]
    assert [p["iteration"] for p in board["iterations"]] == list(range(14))
    assert all(p["graded"] == BATCH * GROUP and p["groups"] == BATCH for p in board["iterations"])
    served_qa = {sid for batch in batches for sid in batch if sid.startswith("qa:")}
    rates = {h["source"]: h for h in board["pass_rates"]}
    assert rates["qa"]["records"] == 40
    assert rates["qa"]["graded_records"] == len(served_qa)
    assert sum(rates["qa"]["bins"]) == len(served_qa)
    # Random answers to "2i": mostly wrong, so most groups scored alike (all zero).
    zero = sum(p["zero_variance_groups"] for p in board["iterations"])
    assert 0 < zero < 14 * BATCH


def test_a_learning_progress_stage_shows_its_weights_over_time(
    serve: Callable[[str], AbstractContextManager[str]],
) -> None:
    with serve("mix.db") as url, httpx.Client(base_url=url, timeout=60) as client:
        batches = run_steps(url, range(22))
        state = client.get("/curriculum").json()
        board = client.get("/dashboard").json()
    fixed, progress = state["stages"][2], state["stages"][3]
    assert fixed["mixing"] == "fixed" and fixed["mix_weights"] is None and fixed["mix_history"] is None
    assert progress["mixing"] == "learning_progress"
    assert set(progress["mix_weights"]) == {"qa", "add"} and sum(progress["mix_weights"].values()) == pytest.approx(1)
    assert min(progress["mix_weights"].values()) >= 0.2 - 1e-9
    assert set(progress["learning_signals"]) == {"qa", "add"}
    history = progress["mix_history"]
    assert [p["iteration"] for p in history] == list(range(18, 22))
    # The live page's timeline carries the same weights, iteration by iteration; fixed stages carry none.
    points = {p["iteration"]: p["mix_weights"] for p in board["iterations"]}
    assert all(points[p["iteration"]] == p["weights"] for p in history)
    assert all(points[i] is None for i in range(18))
    # Each batch of the stage is split by its iteration's weights, within one prompt of the exact share.
    for point in history:
        batch = batches[point["iteration"]]
        for source, weight in point["weights"].items():
            served = sum(sid.startswith(f"{source}:") for sid in batch)
            assert abs(served - weight * BATCH) < 2
