"""proctor preview --simulate: a simulated learner trained on the curriculum's own stages, samplers and gates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proctor.cli.main import main


@pytest.fixture
def ladder(tmp_path: Path) -> Path:
    """Two sources whose records carry a `level`: a gated warm-up on the easy one, then both, learnability."""
    for name, base in (("easy", 0.0), ("hard", 5.0)):
        rows = [{"question": f"{name} {i}", "answer": "1", "level": base + 0.1 * i} for i in range(30)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {"prompt_field": "question", "difficulty_field": "level", "graders": ["numeric"]}
    doc = {
        "name": "ladder",
        "seed": 4,
        "sources": {name: {"path": f"{name}.jsonl", **source} for name in ("easy", "hard")},
        "stages": [
            {
                "name": "warm",
                "until_step": 30,
                "mix": [{"source": "easy"}],
                "advance": {"threshold": 0.6, "window": 32, "min_steps": 2},
            },
            {
                "name": "both",
                "until_step": 60,
                "mix": [{"source": "easy"}, {"source": "hard"}],
                "sampler": {"kind": "learnability"},
            },
        ],
    }
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_simulate_shows_each_stage_its_records_and_the_transitions(
    ladder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["preview", str(ladder), "--simulate", "--lag", "2", "--group-size", "4"]) == 0
    out = capsys.readouterr().out
    sim = out[out.index("simulated learner") :]

    assert sim.startswith("simulated learner, steps 0:60: 8 prompts × 4 completions per step, statistics 2 steps")
    assert "easy: each record's 'level' field, scaled onto [-1, 6] logits" in sim
    runs = re.findall(r"(\d+)–(\d+)\s+(\w+) \((\w+)\): (\d+) iterations, held-out pass rate ([\d.]+) → ([\d.]+)", sim)
    assert [(r[2], r[3]) for r in runs] == [("warm", "uniform"), ("both", "learnability")]
    assert runs[0][0] == "0" and runs[1][1] == "59"
    assert int(runs[0][1]) + 1 == int(runs[1][0])  # the gate ended the warm-up early
    assert float(runs[1][6]) > float(runs[0][5])
    assert re.search(r"zero-variance groups \d+% of \d+", sim)
    # The most served records of each stage, with the server's posterior pass rate.
    assert len(re.findall(r"served most: (?:(?:easy|hard):\w+:\d+ ×\d+ p̂ [\d.]+(?:, )?)+", sim)) == 2
    assert re.search(r"step \d+: warm → both: gate: mean reward [\d.]+ ≥ 0.6 over the last 32 graded", sim)
    assert "end: held-out pass rate" in sim


def test_simulate_an_endless_source_keeps_no_posterior(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preview", "arithmetic", "--simulate", "--steps", ":30"]) == 0
    sim = capsys.readouterr().out.split("simulated learner", 1)[1]
    assert "add_1d: the source's difficulty (0.00): uniform over" in sim
    assert "every record served once (an endless source keeps no per-record statistics)" in sim
    assert "statistics 1 step behind the learner" in sim  # the default lag: a real client's


def test_simulate_from_the_command_line(ladder: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proctor.cli", "preview", str(ladder), "--simulate", "--steps", "0:20"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "simulated learner, steps 0:20:" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--simulate", "--lag", "-1"], "--lag: the statistics lag behind by 0 iterations or more, got -1"),
        (["--simulate", "--group-size", "1"], "--group-size: GRPO compares 2 completions per prompt or more, got 1"),
        (["--simulate", "--steps", "5:40"], "--steps: --simulate trains from step 0; give :STOP or 0:STOP, got 5:40"),
        (["--lag", "2"], "--lag applies only to the simulated learner: add --simulate"),
        (["--lag", "2", "--group-size", "4"], "--lag and --group-size apply only to the simulated learner"),
        (["--simulate", "--batch-size", "0"], "--batch-size: need 1 prompt per step or more, got 0"),
    ],
)
def test_simulate_refuses_bad_flags(ladder: Path, flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["preview", str(ladder), *flags])


def test_a_flag_that_is_not_a_number_is_refused(ladder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["preview", str(ladder), "--simulate", "--lag", "soon"])
    assert "argument --lag: invalid int value: 'soon'" in capsys.readouterr().err


def test_simulate_shows_a_learning_progress_stage_moving_its_weights(
    ladder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(ladder.read_text())
    doc["stages"][1]["mixing"] = {"kind": "learning_progress", "params": {"floor": 0.1}}
    ladder.write_text(yaml.safe_dump(doc, sort_keys=False))

    assert main(["preview", str(ladder), "--simulate"]) == 0
    sim = capsys.readouterr().out
    [(first, last)] = re.findall(r"source weights: (easy [\d.]+, hard [\d.]+) → (easy [\d.]+, hard [\d.]+)", sim)
    assert first == "easy 0.50, hard 0.50"  # no signal yet: the mix as written
    weights = dict(part.split() for part in last.split(", "))
    assert all(float(w) >= 0.1 for w in weights.values()) and weights != {"easy": "0.50", "hard": "0.50"}
    assert sim.count("source weights:") == 1  # the fixed warm-up stage has none
