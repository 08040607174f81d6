"""proctor validate | preview, and serve's start-up errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proctor.cli.main import main


def test_validate_ok(curriculum_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(curriculum_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {curriculum_file}")
    assert "3 stages over 30 iterations" in out
    assert "qa (jsonl, 6)" in out
    assert "add (arithmetic, ∞)" in out


def test_validate_names_the_yaml_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    doc = {
        "name": "bad",
        "sources": {"a": {"kind": "arithmetic", "graders": ["numeric"]}},
        "stages": [
            {"name": "s0", "until_step": 5, "mix": [{"source": "a"}]},
            {"name": "s1", "until_step": 9, "mix": [{"source": "gsm9k"}]},
        ],
    }
    bad.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"proctor validate: invalid curriculum {bad}:" in err
    assert "stages[1].mix[0].source: unknown source 'gsm9k' (known: a)" in err


def test_validate_reports_every_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    doc = {
        "name": "bad",
        "sources": {
            "words": {"path": "missing.jsonl", "graders": ["nope"]},
            "add": {"kind": "arithmetic", "graders": ["numeric"], "ops": ["%"]},
        },
        "stages": [
            {"name": "s0", "until_step": 10, "mix": [{"source": "words", "weight": -1}]},
            {"name": "s1", "until_step": 20, "mix": [{"source": "gsm9k"}]},
            {"name": "s1", "until_step": 15, "mix": [{"source": "add"}], "advance": {"threshold": 0.5}},
        ],
    }
    bad.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"proctor validate: invalid curriculum {bad}:"
    assert sorted(lines[1:]) == sorted(
        [
            # Fields that do not parse ...
            "  sources.add.ops[0]: Input should be '+', '-' or '*'",
            "  stages[0].mix[0].weight: Input should be greater than 0",
            # ... the parts that do, against each other ...
            "  stages[1].mix[0].source: unknown source 'gsm9k' (known: add, words)",
            "  stages[2].name: stage 's1' is defined twice",
            "  stages[2].until_step: must be greater than the previous stage's (20)",
            "  stages[2].advance: the last stage has no next stage to advance to",
            # ... and the sources that parsed, against their data and graders.
            f"  sources.words.path: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory",
            "  sources.words.graders[0].name: unknown grader 'nope'; use a built-in one or declare it under "
            "`graders` (code, exact_match, json_schema, json_valid, length_cap, math, numeric, reasoning_core, "
            "reasoning_gym, regex, think_format)",
        ]
    )


def test_validate_a_shipped_curriculum_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "word_problems"]) == 0
    assert "curriculum 'word_problems'" in capsys.readouterr().out


def test_preview(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preview", "arithmetic", "--steps", "0:250"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("arithmetic (hash ")
    runs = [line.split() for line in lines if "–" in line and "[" in line]
    assert [(r[0], r[1]) for r in runs] == [
        ("0–19", "one_digit"),
        ("20–59", "two_digit"),
        ("60–119", "multiply"),
        ("120–249", "mixed"),
    ]
    assert "may end early: mean reward ≥ 0.8 over 64 graded completions, after ≥ 5 steps" in out
    assert "past total_iterations" in out
    prompts = [line for line in lines if line.startswith("  ") and "→" in line]
    assert [p.split()[0] for p in prompts] == ["one_digit", "two_digit", "multiply", "mixed"]


@pytest.mark.parametrize("steps", ["x:y", "5:5", "-1:3"])
def test_preview_bad_steps(steps: str) -> None:
    with pytest.raises(SystemExit, match="--steps"):
        main(["preview", "arithmetic", f"--steps={steps}"])


def test_serve_refuses_a_bad_setting(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PROCTOR_MAX_BATCH_SIZE", "lots")
    assert main(["serve", "arithmetic", "--database-url", ":memory:"]) == 2
    assert "PROCTOR_MAX_BATCH_SIZE (max_batch_size): Input should be a valid integer" in capsys.readouterr().err


def test_serve_runs_several_processes_of_a_postgresql_database_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "run.db"
    assert main(["serve", "arithmetic", "--database-url", str(state), "--workers", "2"]) == 2
    assert capsys.readouterr().err == (
        f"proctor serve: --workers 2 (PROCTOR_WORKERS) runs server processes of one PostgreSQL database, and this "
        f"run's state is the SQLite file {state}, which one process serves: give a PostgreSQL database "
        "(--database-url postgresql://…), or leave --workers at 1\n"
    )
    assert not state.exists()
    assert main(["serve", "arithmetic", "--database-url", str(state), "--workers", "0"]) == 2
    assert "PROCTOR_WORKERS (workers): Input should be greater than or equal to 1; got 0" in capsys.readouterr().err


def test_serve_reads_no_option_from_a_prefix_of_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    # --state is a prefix of --state-dir: abbreviated, it would place a fresh run under a directory of that name.
    with pytest.raises(SystemExit) as info:
        main(["serve", "arithmetic", "--state", "runs/mine.db"])
    assert info.value.code == 2
    assert "unrecognized arguments: --state runs/mine.db" in capsys.readouterr().err


def test_fresh_keeps_the_state_while_the_port_is_taken(
    tmp_path: Path, curriculum_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "run.db"
    state.write_bytes(b"a run's state")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", str(curriculum_file), "--database-url", str(state), "--fresh", "--port", str(port)]
        assert main(args) == 2
    assert capsys.readouterr().err == (
        f"proctor serve: --fresh: 127.0.0.1:{port} is in use, perhaps by this run's own server; stop it, then start "
        "again with --fresh\n"
    )
    assert state.read_bytes() == b"a run's state"


def test_serve_refuses_a_transitions_file_that_is_not_a_history(
    tmp_path: Path, curriculum_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "curriculum.json"
    history.write_text("[]")
    args = ["serve", str(curriculum_file), "--database-url", str(tmp_path / "s.db"), "--transitions", str(history)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"proctor serve: --transitions {history}: not a GET /curriculum answer")
    assert "curl -s $PROCTOR_URL/curriculum > FILE" in err


def _train_without(module: str) -> subprocess.CompletedProcess[str]:
    """`proctor train` in a process where ``module`` cannot be imported."""
    code = f"import sys; sys.modules[{module!r}] = None; from proctor.cli.main import main; sys.exit(main(['train']))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.e2e  # `proctor train` in a process of its own, which imports torch
def test_train_without_the_train_extra_says_how_to_install_it() -> None:
    run = _train_without("torch")
    assert run.returncode == 2
    assert run.stderr == (
        "proctor train: error: needs the train extra (torch, transformers, TRL), and torch is not installed: run "
        "`make train` (or `make demo`) from a checkout, or `pip install 'proctor[train]'`\n"
    )


@pytest.mark.e2e  # `proctor train` in a process of its own, which imports torch
def test_another_import_error_is_not_blamed_on_the_extra() -> None:
    run = _train_without("proctor.client.training.trainer")
    assert run.returncode == 1
    assert "ModuleNotFoundError" in run.stderr
    assert "train extra" not in run.stderr
