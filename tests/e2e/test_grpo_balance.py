"""Rows balanced across two training processes by tokens (torchrun, gloo on the CPU): the gradients after one
step are those of the unbalanced run, and the heaviest process carries fewer tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

import pytest
import torch

from proctor.cli.launcher import free_port

pytestmark = pytest.mark.e2e
VARIANTS = ["grpo-stock", "grpo-unbalanced", "grpo-balanced", "dapo-stock", "dapo-balanced"]


class Run(TypedDict):
    """What ddp_balance.py saves of a variant: the gradients after the step, and the batching metrics logged."""

    grads: dict[str, torch.Tensor]
    logs: dict[str, float]


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("balance")
    script = Path(__file__).with_name("ddp_balance.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(script), str(tiny_model), str(out), *VARIANTS,
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {v: torch.load(out / f"{v}.pt", weights_only=True) for v in VARIANTS}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(("variant", "reference"), [
    ("grpo-balanced", "grpo-stock"), ("grpo-unbalanced", "grpo-stock"), ("dapo-balanced", "dapo-stock"),
])  # fmt: skip
def test_the_gradients_equal_the_unbalanced_run(runs: dict[str, Run], variant: str, reference: str) -> None:
    grads, expected = runs[variant]["grads"], runs[reference]["grads"]
    assert largest_difference(grads, expected) <= 1e-5
    assert max(g.abs().max().item() for g in expected.values()) > 1e-3


def test_the_heaviest_process_carries_fewer_tokens(runs: dict[str, Run]) -> None:
    logs = runs["grpo-balanced"]["logs"]
    balanced, unbalanced = logs["batching/heaviest_rank_tokens"], logs["batching/heaviest_rank_tokens_unbalanced"]
    # The trainer logs both per step (86 tokens unbalanced, 67 balanced when this was written).
    assert balanced < unbalanced, f"heaviest process: {unbalanced} tokens unbalanced, {balanced} balanced"
