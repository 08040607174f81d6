"""bench/ab.py: another commit's server runs from a worktree of it, the runs of the two builds alternate, and the
table compares their medians. No figure is asserted: the numbers are the benchmark's to report."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import ab
from bench._baseline import checkout


def test_a_checkout_imports_proctor_from_that_commit() -> None:
    code = "import proctor.cli, proctor.server.app, proctor.experience.store as s; print(s.__file__)"
    with checkout("HEAD") as (env, module):
        found = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
        )
        assert module == "proctor.cli"
        where = Path(found.stdout.strip())
        assert where.is_relative_to(env["PYTHONPATH"])
        assert not where.resolve().is_relative_to(ab.ROOT)  # the worktree's file, not this checkout's
        assert where.resolve().name == "store.py"


def test_an_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^state must be one of sqlite, postgresql, remote, got 'mysql'$"):
        ab.run("HEAD", state="mysql")


def test_the_command_line_refuses_no_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        ab.main(["--base", "HEAD", "--pairs", "0"])
    assert exited.value.code == 2
    assert "--pairs must be at least 1 and --seconds positive" in capsys.readouterr().err


def test_the_command_line_refuses_a_commit_it_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        ab.main(["--base", "no-such-ref"])
    assert exited.value.code == 2
    assert "--base no-such-ref: no such commit in this clone" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_builds_alternate_and_the_table_compares_their_medians(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(ab)
    ab.main(["--base", "HEAD", "--pairs", "2", "--seconds", "0.5"])
    results = saved["ab"]
    assert [(r["pair"], r["build"]) for r in results["runs"]] == [(0, "base"), (0, "this"), (1, "this"), (1, "base")]
    assert all(r[key]["requests"] > 0 and r[key]["cpu_ms"] > 0 for r in results["runs"] for key in ("sample", "grade"))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| /")]
    assert len(lines) == 6, out
    assert lines[0].startswith(f"| /sample new iteration (batch 16) | base ({results['base']}) | 2 | ")
    assert lines[2].startswith("| /sample new iteration (batch 16) | this ÷ base (rate), − base (p99, CPU) | | ")
    assert lines[5].startswith("| /grade (64 completions) | this ÷ base (rate), − base (p99, CPU) | | ")
