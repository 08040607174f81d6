"""bench/curriculum_run.py: its quick mode end to end (real servers, real GRPO runs of the tiny model), its table and
its plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import curriculum_run as bench


def test_the_staged_curriculum_is_a_gated_ladder_and_the_others_one_stage() -> None:
    staged = bench.curriculum_doc("staged gates", 300, seed=1)["stages"]
    assert [s["mix"] for s in staged] == [[{"source": f"level{k}"}] for k in bench.LEVELS]
    assert [("advance" in s, s.get("replay", 0.0)) for s in staged] == [
        (True, 0.0),
        (True, 0.1),
        (True, 0.1),
        (False, 0.1),
    ]
    [progress] = bench.curriculum_doc("learning_progress", 300, seed=1)["stages"]
    assert progress["mixing"] == {"kind": "learning_progress"} and "refill" not in progress
    [refilled] = bench.curriculum_doc("learning_progress + refill", 300, seed=1)["stages"]
    assert refilled == {**progress, "refill": {"kind": "zero_variance"}}
    [uniform] = bench.curriculum_doc("uniform", 300, seed=1)["stages"]
    assert "mixing" not in uniform and len(uniform["mix"]) == len(bench.LEVELS)


def test_held_out_prompts_are_never_served() -> None:
    train = {r["prompt"] for k in bench.LEVELS for r in bench.records(k, range(bench.COPIES), "train")}
    held = {r["prompt"] for k in bench.LEVELS for r in bench.records(k, range(100, 100 + bench.HELD_OUT), "held-out")}
    assert train.isdisjoint(held)
    for k in bench.LEVELS:
        for r in bench.records(k, range(1), "train"):
            assert r["prompt"].startswith(f"Say the word {r['answer']}")
            assert r["prompt"].count(",") == k  # the distractors, each after a comma


@pytest.mark.e2e
def test_the_quick_run_trains_every_curriculum_and_plots_them(
    tmp_path: Path, saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)

    bench.main(["--quick", "--plot", str(tmp_path / "curves.png")])

    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| curriculum", "| ---"))
    ]
    assert [row.split("|")[1].strip() for row in rows] == list(bench.CURRICULA)
    runs = saved["curriculum_run"]
    assert [r["curriculum"] for r in runs] == list(bench.CURRICULA)
    for r in runs:
        assert [p["step"] for p in r["held_out"]] == [0, 3, 6]
        assert all(0.0 <= p["held_out"] <= 1.0 for p in r["held_out"])
        assert len(r["reward"]) == 6 and all(v is not None for v in r["reward"])
        assert len(r["rollouts"]) == 6 and r["rollouts"][0] >= bench.PROMPTS * bench.GROUP
        assert r["rollouts"] == sorted(r["rollouts"])
        refilled = r["rollouts"][-1] - 6 * bench.PROMPTS * bench.GROUP
        assert refilled % bench.GROUP == 0 and (refilled == 0 or r["curriculum"].endswith("refill"))
        assert len(r["zero_std"]) == 6 and all(0.0 <= z <= 1.0 for z in r["zero_std"])
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
