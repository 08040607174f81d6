"""``remote_reward(components=True)`` under TRL's ``multi_objective_aggregation="normalize_then_sum"``: each
grader is a reward function of its own, all fed by one ``/grade`` a step, and the advantages TRL trains on are
the ones the dataserver's own component scores give."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer
from trl import GRPOConfig  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.client import ProctorClient, RemoteRLDataset, remote_reward
from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOTrainer
from proctor.wire.dataserver import GradeItem

pytestmark = pytest.mark.e2e
GENERATIONS = 4
STEPS = 3

# Two graders of one source, weighted 2 : 1, both with spread on the tiny model's random completions.
GRADERS = """
def length(sample):
    return min(1.0, len(sample.completion) / 40)

def digits(sample):
    return float(any(c.isdigit() for c in sample.completion))
"""
CURRICULUM = {
    "name": "components",
    "seed": 2,
    "sources": {
        "sums": {
            "kind": "arithmetic",
            "graders": [{"name": "length", "weight": 2}, {"name": "digits", "weight": 1}],
        }
    },
    "graders": {"length": {"python": "./graders.py:length"}, "digits": {"python": "./graders.py:digits"}},
    "stages": [{"name": "only", "until_step": 50, "mix": [{"source": "sums"}]}],
}


@pytest.fixture
def curriculum_file(tmp_path: Path) -> Path:
    folder = tmp_path / "components"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    path = folder / "components.yaml"
    path.write_text(yaml.safe_dump(CURRICULUM, sort_keys=False))
    return path


class Recording(ProctorGRPOTrainer):
    """Keeps each generation batch's reward columns (as TRL gathered them) and the advantages it computed."""

    steps: list[dict[str, Any]]

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids: Any) -> Any:
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids)
        columns = ("sample_id", "slot", "completion_index", "iteration")
        rows = [
            {k: row[k] for k in columns} | {"completion": c if isinstance(c, str) else c[-1]["content"]}
            for row, c in zip(inputs, completions, strict=True)
        ]  # a chat completion's text is its last message's
        self.steps.append({"rows": rows, "per_func": per_func.cpu().numpy()})
        return per_func

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        out = super()._generate_and_score_completions(inputs)
        self.steps[-1]["advantages"] = out["advantages"].cpu().numpy()
        return out


def normalize_then_sum(scores: np.ndarray, weights: list[float], group: int) -> np.ndarray:
    """TRL's normalize_then_sum, from the components: each component standardised within its group, the
    weighted sum standardised over the batch (sample standard deviations, 1e-4 added)."""
    grouped = scores.reshape(-1, group, scores.shape[1])
    normalised = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-4)
    summed = (normalised.reshape(-1, scores.shape[1]) * np.array(weights)).sum(1)
    advantages: np.ndarray = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-4)
    return advantages


@pytest.mark.parametrize("through", ["grade", "store"])
def test_normalize_then_sum_trains_on_the_servers_component_scores(
    through: Any, live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    sent: list[httpx.Request] = []

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            sent.append(request)
            return super().handle_request(request)

    with live_server() as url, ProctorClient(url, transport=Counting()) as client:
        config = GRPOConfig(
            **run_defaults(tmp_path / "run"),
            per_device_train_batch_size=8,
            num_generations=GENERATIONS,
            max_completion_length=8,
            max_steps=STEPS,
            shuffle_dataset=False,
            multi_objective_aggregation="normalize_then_sum",
        )
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
        funcs = remote_reward(client, dataset=dataset, through=through, components=True)
        assert [(f.__name__, f.weight) for f in funcs] == [("length", 2 / 3), ("digits", 1 / 3)]
        weights = [f.weight for f in funcs if f.weight is not None]
        config.reward_weights = weights
        trainer = Recording(
            model=str(tiny_model), reward_funcs=funcs, args=config, train_dataset=dataset, processing_class=tokenizer
        )
        trainer.steps = []
        trainer.train()
        dataset.close()
        # One fetch of grades per generation step, for both reward functions: a /grade, or the trainer's posts
        # and reads of the step's table.
        grades = sum(r.url.path == "/grade" for r in sent)
        assert grades == (STEPS if through == "grade" else 0)
        logged = [h for h in trainer.state.log_history if "rewards/length/mean" in h]
        assert len(logged) == STEPS and all("rewards/digits/mean" in h for h in logged)

        assert len(trainer.steps) == STEPS
        for step in trainer.steps:
            rows = step["rows"]
            # The server's own component scores of the step's completions (asked again: the stored grades).
            items = [
                GradeItem(
                    sample_id=r["sample_id"], slot=r["slot"], completion=r["completion"],
                    completion_index=r["completion_index"],
                )
                for r in rows
            ]  # fmt: skip
            results = client.grade(items, iteration=rows[0]["iteration"]).results
            assert all(r.cached for r in results)
            server = np.array([[r.components["length"], r.components["digits"]] for r in results])
            np.testing.assert_allclose(step["per_func"], server, rtol=0, atol=1e-6)
            np.testing.assert_allclose(
                step["advantages"], normalize_then_sum(server, weights, GENERATIONS), rtol=1e-4, atol=1e-4
            )
            # And it is not the plain reward's advantage: the components carry their own scales.
            assert np.isfinite(step["advantages"]).all() and np.abs(step["advantages"]).max() > 0
