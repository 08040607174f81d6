"""`make demo` (`proctor demo`): a real server, the tiny model, a stage boundary crossed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_crosses_a_stage_boundary() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "-m", "proctor.cli", "demo", "--steps", "22"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 22
    assert "stage one_digit" in steps[0]
    assert "stage two_digit" in steps[-1]
    assert "  iteration   20: one_digit → two_digit (reached until_step 20)" in lines
