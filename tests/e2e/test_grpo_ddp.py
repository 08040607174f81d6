"""Two training processes (torchrun, gloo on the CPU) against one dataserver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import free_port

pytestmark = pytest.mark.e2e
STEPS = 3


def test_two_processes_share_every_generation_step(
    live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    script = Path(__file__).with_name("ddp_grpo.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with live_server() as url:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(script), url, str(tiny_model), str(tmp_path), str(STEPS),
        ]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        batches = {i: httpx.post(url + "/sample", json={"iteration": i, "batch_size": 1}).json() for i in range(STEPS)}
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    # Both ranks asked for the same iterations, each once.
    assert ranks[0]["requested"] == ranks[1]["requested"] == list(range(len(ranks[0]["requested"])))
    for step in range(STEPS):
        rows = [(sid, idx) for r in ranks for call in r["calls"] if call["iteration"][0] == step
                for sid, idx in zip(call["sample_id"], call["completion_index"], strict=True)]  # fmt: skip
        # The step's one prompt, its four completions split two and two over the ranks: every
        # (sample_id, completion_index) exactly once, no duplicate and no missing slot.
        expected = {(s["sample_id"], k) for s in batches[step]["samples"] for k in range(4)}
        assert Counter(rows) == Counter(expected)
        for r in ranks:
            [call] = [c for c in r["calls"] if c["iteration"][0] == step]
            assert len(set(call["sample_id"])) == 1  # each rank's half of the group is the same prompt


def test_two_processes_resumed_in_the_middle_of_a_generation_train_on_through_the_store(
    live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """Stock TRL on two processes, rewards through the store: a checkpoint after the first of a generation's
    two optimizer steps, then a run resumed from it (another seed: other completions of that step)."""
    script = Path(__file__).with_name("ddp_grpo.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with live_server() as url:
        for resume, seed in (("-", "1"), (str(tmp_path / "run" / "checkpoint-1"), "2")):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                str(script), url, str(tiny_model), str(tmp_path), str(STEPS), "store", "2", resume, seed,
            ]  # fmt: skip
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        tables = httpx.get(url + "/experience").json()["tables"]
    # The resumed run's new completions of the interrupted step are kept beside the first run's.
    assert any(t["iteration"] < 0 and t["written"].get("reward") for t in tables), tables
