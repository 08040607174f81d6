"""The simulated learner and its driver, run through the real store, progress and samplers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.simulation import (
    LATENT_EASIEST,
    LATENT_HARDEST,
    Learner,
    LearnerModel,
    Population,
    advantage_mass,
    population_from_curriculum,
    simulate,
)

WriteCurriculum = Callable[..., Path]  # the write_curriculum fixture (tests/server/curriculum/conftest.py)
LEVELS = {"easy": [0.1 * k for k in range(40)], "hard": [3.0 + 0.1 * k for k in range(40)]}


def _ladder(write_curriculum: WriteCurriculum, sampler: dict[str, Any] | None = None) -> Curriculum:
    """Two file sources whose records carry a `level`; a gated first stage, then both (with ``sampler``)."""
    files = {
        f"{name}.jsonl": "".join(json.dumps({"prompt": f"{name} {i}", "level": v}) + "\n" for i, v in enumerate(values))
        for name, values in LEVELS.items()
    }
    source = {"answer_field": None, "difficulty_field": "level", "graders": ["numeric"]}
    second: dict[str, Any] = {"name": "both", "until_step": 400, "mix": [{"source": "easy"}, {"source": "hard"}]}
    if sampler is not None:
        second["sampler"] = sampler
    doc = {
        "name": "ladder",
        "seed": 3,
        "sources": {name: {"path": f"{name}.jsonl", **source} for name in LEVELS},
        "stages": [
            {
                "name": "warm",
                "until_step": 200,
                "mix": [{"source": "easy"}],
                "advance": {"threshold": 0.6, "window": 32, "min_steps": 2},
            },
            second,
        ],
    }
    return load_curriculum(write_curriculum(doc, files))


def test_advantage_mass_is_grpo_mean_absolute_advantage() -> None:
    rewards = np.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0], [1] * 8, [0] * 8], dtype=np.float64)

    mass = advantage_mass(rewards)

    # One pass in eight: mean 1/8, std √7/8; |A| is 7/√7 once and 1/√7 seven times.
    assert mass[0] == pytest.approx(2 * math.sqrt(7 / 64), rel=1e-3)
    assert mass[1] == pytest.approx(1.0, rel=1e-3)
    assert mass[2] == mass[3] == 0.0


def test_the_skill_moves_by_the_exact_grpo_gradient_and_only_on_groups_that_differ() -> None:
    population = Population({"a": np.zeros(4), "b": np.zeros(4)}, {}, {"a": np.zeros(2)}, {}, seed=0)
    learner = Learner(population, LearnerModel(group_size=4, step_size=1.0), seed=0)
    picks = [("a", 0), ("a", 1), ("b", 2)]
    rewards = np.array([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)

    learner.learn(picks, rewards)

    # d/ds of mean_j A_j log σ(s − d) over the batch's completions: Σ_j A_j r_j / (B · G) for the first group.
    a = (rewards[0] - 0.5) / (0.5 + 1e-4)
    assert learner.skill_of("a") == pytest.approx(float((a * rewards[0]).sum()) / (3 * 4))
    assert learner.skill_of("b") == 0.0  # its one group scored alike: no signal
    assert learner.held_out_pass_rate() == pytest.approx(1 / (1 + math.exp(-learner.skill_of("a"))))


def test_a_per_record_learner_keeps_part_of_each_step_with_the_record() -> None:
    population = Population({"a": np.zeros(4)}, {}, {"a": np.zeros(2)}, {}, seed=0)
    whole = Learner(population, LearnerModel(group_size=4), seed=0)
    split = Learner(population, LearnerModel(group_size=4, record_share=0.5), seed=0)
    picks = [("a", 0), ("a", 1)]
    rewards = np.array([[1, 0, 1, 0], [1, 1, 1, 1]], dtype=np.float64)

    whole.learn(picks, rewards)
    split.learn(picks, rewards)

    assert split.skill_of("a") == pytest.approx(whole.skill_of("a") / 2)
    # Record 0's own logit moves by half of step_size · mean |A| (1 for a half-right group); record 1 scored alike.
    assert split.record_skill["a"].tolist() == pytest.approx([0.5 * (1 / (1 + 2e-4)), 0.0, 0.0, 0.0])
    assert split.pass_probability([("a", 0)])[0] > split.pass_probability([("a", 2)])[0]
    # Held-out records have no logit of their own; the sources' own records do.
    assert split.held_out_pass_rate() == pytest.approx(1 / (1 + math.exp(-split.skill_of("a"))))
    assert split.trained_pass_rate() > split.held_out_pass_rate()
    with pytest.raises(ValueError, match=r"record_share must be in \[0, 1\), got 1.0"):
        Learner(population, LearnerModel(record_share=1.0), seed=0)


def test_a_run_counts_the_rollouts_it_generated(write_curriculum: WriteCurriculum) -> None:
    curriculum = _ladder(write_curriculum)
    population = population_from_curriculum(curriculum, seed=1, held_out=100)

    result = simulate(curriculum, population, steps=30, batch_size=8, model=LearnerModel(group_size=4))

    assert [s.rollouts for s in result.steps] == [8 * 4 * (n + 1) for n in range(30)]
    target = result.steps[-1].held_out
    steps = result.steps_to(target)
    assert steps is not None and result.rollouts_to(target) == steps * 8 * 4
    assert result.steps_to(2.0) is None and result.rollouts_to(2.0) is None


def test_a_run_is_a_function_of_its_seed(write_curriculum: WriteCurriculum) -> None:
    curriculum = _ladder(write_curriculum, {"kind": "learnability"})
    population = population_from_curriculum(curriculum, seed=1, held_out=100)

    first = simulate(curriculum, population, steps=40, batch_size=8, seed=7)
    again = simulate(curriculum, population, steps=40, batch_size=8, seed=7)
    other = simulate(curriculum, population, steps=40, batch_size=8, seed=8)

    assert first.steps == again.steps
    assert first.steps != other.steps
    assert len(first.steps) == 40
    assert first.steps[-1].held_out > first.initial_held_out


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_grades_are_folded_in_only_after_lag_more_iterations_are_drawn(
    write_curriculum: WriteCurriculum, lag: int
) -> None:
    # The first stage is uniform, so the batches and the learner's rewards before the gate fires are the same
    # whatever the lag: the gate sees each grade exactly `lag` iterations later.
    curriculum = _ladder(write_curriculum)
    population = population_from_curriculum(curriculum, seed=1, held_out=100)

    [at_once] = simulate(curriculum, population, steps=120, batch_size=8, lag=0).transitions
    [behind] = simulate(curriculum, population, steps=120, batch_size=8, lag=lag).transitions

    assert behind.iteration == at_once.iteration + lag
    assert behind.reason.startswith("gate: mean reward")


def test_stage_runs_report_the_served_records_and_their_posteriors(write_curriculum: WriteCurriculum) -> None:
    curriculum = _ladder(write_curriculum, {"kind": "learnability"})
    population = population_from_curriculum(curriculum, seed=1, held_out=100)

    result = simulate(curriculum, population, steps=60, batch_size=8, top=3)

    warm, both = result.stages
    assert (warm.name, warm.sampler, warm.first) == ("warm", "uniform", 0)
    assert (both.name, both.sampler, both.first, both.stop) == ("both", "learnability", warm.stop, 60)
    assert both.held_out_start == warm.held_out_end
    assert sum(r.groups for r in result.stages) == 60 * 8
    assert len(both.top) == 3
    assert all(r.sample_id.split(":")[0] in LEVELS and r.pass_rate is not None for r in both.top)
    assert all(0 < r.pass_rate < 1 for r in both.top if r.pass_rate is not None)


def test_population_takes_the_difficulty_the_curriculum_has(write_curriculum: WriteCurriculum) -> None:
    doc = {
        "name": "kinds",
        "sources": {
            "rows": {"path": "rows.jsonl", "difficulty_field": "level", "answer_field": None, "graders": ["numeric"]},
            "plain": {"path": "plain.jsonl", "answer_field": None, "graders": ["numeric"]},
            "add": {"kind": "arithmetic", "ops": ["+"], "digits": [1, 1], "graders": ["numeric"]},
            "mul": {"kind": "arithmetic", "ops": ["*"], "digits": [1, 3], "graders": ["numeric"]},
        },
        "stages": [{"name": "s", "until_step": 5, "mix": [{"source": s} for s in ("rows", "plain", "add", "mul")]}],
    }
    files = {
        "rows.jsonl": "".join(json.dumps({"prompt": str(i), "level": i}) + "\n" for i in range(5)),
        "plain.jsonl": "".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(5)),
    }
    curriculum = load_curriculum(write_curriculum(doc, files))

    population = population_from_curriculum(curriculum, seed=0, held_out=10)

    assert population.tables["rows"].tolist() == pytest.approx(np.linspace(LATENT_EASIEST, LATENT_HARDEST, 5))
    assert "'level' field" in population.origin["rows"]
    assert population.origin["plain"].startswith("no difficulty known")
    assert population.origin["add"].startswith("the source's difficulty")
    # The endless sources' records are drawn on demand, the easier source's from a lower range.
    assert population.ranges["add"][0] < population.ranges["mul"][0]
    assert population.difficulties("add", [10**12]).tolist() == population.difficulties("add", [10**12]).tolist()
    assert sum(len(d) for d in population.held_out.values()) == 10


def test_a_group_of_one_completion_is_refused(write_curriculum: WriteCurriculum) -> None:
    curriculum = _ladder(write_curriculum)
    population = population_from_curriculum(curriculum, seed=1, held_out=10)
    with pytest.raises(ValueError, match="2 completions or more"):
        simulate(curriculum, population, steps=1, model=LearnerModel(group_size=1))


def test_held_out_records_are_kept_apart() -> None:
    population = Population({"a": np.full(3, 9.0)}, {}, {"a": np.full(2, -9.0)}, {}, seed=0)
    learner = Learner(population, LearnerModel(), seed=0)
    assert learner.pass_probability([("a", 0)])[0] < 0.01
    assert learner.held_out_pass_rate() > 0.99
