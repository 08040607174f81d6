"""Group refill in a real training run: ``ProctorGRPOTrainer(refill_rounds=2)`` on one and on two processes
(torchrun, gloo on the CPU), checked against the server's own refill answers."""

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
import yaml

from proctor.cli.launcher import free_port
from tests.e2e.ddp_refill import GENERATIONS, PROMPTS

pytestmark = pytest.mark.e2e
STEPS = 3
ROUNDS = 2

# Two sources: every group of "dull" scores alike (0), every group of "lively" has spread (the completion's
# length), so the refill rule replaces exactly the dull groups, in every round.
GRADERS = """
def length(sample):
    return min(1.0, len(sample.completion) / 40)

def nothing(sample):
    return 0.0
"""
CURRICULUM = {
    "name": "refill",
    "seed": 3,
    "sources": {
        "dull": {"kind": "arithmetic", "graders": ["nothing"]},
        "lively": {"kind": "arithmetic", "digits": [2, 3], "graders": ["length"]},
    },
    "graders": {"length": {"python": "./graders.py:length"}, "nothing": {"python": "./graders.py:nothing"}},
    "stages": [
        {
            "name": "only",
            "until_step": 50,
            "mix": [{"source": "dull", "weight": 1}, {"source": "lively", "weight": 2}],
            "refill": {"kind": "zero_variance", "max_rounds": ROUNDS},
        }
    ],
}


@pytest.fixture
def curriculum_file(tmp_path: Path) -> Path:
    folder = tmp_path / "refill"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    path = folder / "refill.yaml"
    path.write_text(yaml.safe_dump(CURRICULUM, sort_keys=False))
    return path


def final_rows(url: str, step: int) -> tuple[Counter[tuple[str, int, int]], int]:
    """The rows the step trains on by the server's refill answers (asked again: the same answers), and the
    groups replaced."""
    batch = httpx.post(url + "/sample", json={"iteration": step, "batch_size": PROMPTS}).json()
    occupant = {s["slot"]: s for s in batch["samples"]}  # by the batch's own slot: the group there now
    where = {slot: slot for slot in occupant}  # the batch's slot each current slot stands in
    replaced = 0
    for round_ in range(1, ROUNDS + 1):
        body = {"iteration": step, "round": round_, "group_size": GENERATIONS}
        answer = httpx.post(url + "/refill", json=body).json()
        for r in answer["replacements"]:
            home = where.pop(r["replaces"])
            occupant[home] = r["sample"]
            where[r["sample"]["slot"]] = home
        replaced += len(answer["replacements"])
    rows = Counter((s["sample_id"], s["slot"], k) for s in occupant.values() for k in range(GENERATIONS))
    return rows, replaced


@pytest.mark.parametrize("processes", [1, 2])
def test_refill_trains_on_the_groups_the_server_chose(
    processes: int, live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    script = Path(__file__).with_name("ddp_refill.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with live_server() as url:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(script), url, str(tiny_model), str(tmp_path), str(STEPS), str(ROUNDS),
        ]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        expected = {step: final_rows(url, step) for step in range(STEPS)}
        dashboard = httpx.get(url + "/dashboard").json()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(processes)]
    for step, (rows, replaced) in expected.items():
        # The one dull group of the step was replaced in both rounds (each replacement is dull again).
        assert replaced == ROUNDS
        trained: Counter[tuple[str, int, int]] = Counter()
        for rank in ranks:
            # TRL's own reward call for the step comes last, with all of the process's rows.
            [*_, last] = [c for c in rank["calls"] if c["iteration"][0] == step]
            assert len(last["slot"]) == rank["rows_per_process"]
            trained.update(zip(last["sample_id"], last["slot"], last["completion_index"], strict=True))
        # Across the processes, every row of the step's final groups exactly once: no duplicate, none missing.
        assert trained == rows
        assert sum(1 for _, slot, _ in rows if slot >= PROMPTS) == GENERATIONS  # one group, in a refill slot
    logs = [entry for entry in ranks[0]["logs"] if "proctor/refill_rounds" in entry]
    assert [entry["proctor/refill_rounds"] for entry in logs] == [float(ROUNDS)] * STEPS
    assert [entry["proctor/refilled_groups"] for entry in logs] == [float(ROUNDS)] * STEPS
    points = {p["iteration"]: p for p in dashboard["iterations"]}
    assert [points[step]["refill_rounds"] for step in range(STEPS)] == [ROUNDS] * STEPS
