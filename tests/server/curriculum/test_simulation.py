"""The simulated learner and its driver, run through the real store, progress and samplers."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proctor.server.curriculum import simulation
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.refill import replacement_key
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
from proctor.server.state.rows import GradeRow, StoredGrades
from proctor.server.store import Store

WriteCurriculum = Callable[..., Path]  # the write_curriculum fixture (tests/server/curriculum/conftest.py)
LEVELS = {"easy": [0.1 * k for k in range(40)], "hard": [3.0 + 0.1 * k for k in range(40)]}


def _ladder(
    write_curriculum: WriteCurriculum, sampler: dict[str, Any] | None = None, refill: dict[str, Any] | None = None
) -> Curriculum:
    """Two file sources whose records carry a `level`; a gated first stage, then both (with ``sampler`` and
    ``refill``)."""
    files = {
        f"{name}.jsonl": "".join(json.dumps({"prompt": f"{name} {i}", "level": v}) + "\n" for i, v in enumerate(values))
        for name, values in LEVELS.items()
    }
    source = {"answer_field": None, "difficulty_field": "level", "graders": ["numeric"]}
    second: dict[str, Any] = {"name": "both", "until_step": 400, "mix": [{"source": "easy"}, {"source": "hard"}]}
    if sampler is not None:
        second["sampler"] = sampler
    if refill is not None:
        second["refill"] = refill
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


# --- refill -------------------------------------------------------------------------------------------------

ZERO_VARIANCE = {"kind": "zero_variance"}  # max_rounds 4, the spec's default


def test_refill_trains_on_fewer_zero_variance_groups_and_pays_for_its_replacements(
    write_curriculum: WriteCurriculum,
) -> None:
    plain_curriculum = _ladder(write_curriculum)
    refill_curriculum = _ladder(write_curriculum, refill=ZERO_VARIANCE)
    population = population_from_curriculum(plain_curriculum, seed=1, held_out=100)
    model = LearnerModel(group_size=4)

    plain = simulate(plain_curriculum, population, steps=80, batch_size=8, model=model)
    refill = simulate(refill_curriculum, population, steps=80, batch_size=8, model=model)

    # Without a rule, the batch trained on is the batch drawn.
    assert all(s.trained_zero_variance == s.zero_variance and s.replacements == 0 for s in plain.steps)
    assert plain.trained_zero_variance_share == plain.zero_variance_share
    both = refill.stages[1].first
    assert 0 < both < 40
    assert refill.trained_zero_variance_share < plain.trained_zero_variance_share
    assert refill.trained_zero_variance_share < refill.zero_variance_share
    # Every group generated counts: the batch's 8 and each replacement, 4 completions apiece.
    assert refill.replacements > 0
    assert [s.rollouts for s in refill.steps] == [
        4 * (8 * (n + 1) + sum(r.replacements for r in refill.steps[: n + 1])) for n in range(80)
    ]
    assert refill.steps[-1].rollouts == 4 * (8 * 80 + refill.replacements)
    assert refill.stages[1].replacements == refill.replacements
    for step in refill.steps[both:]:
        alike, trained_alike = round(step.zero_variance * 8), round(step.trained_zero_variance * 8)
        # Round 1 replaces the drawn groups that scored alike, each later round those of the round before that
        # did; a position keeps its first group that differs, so the trained batch never scores alike more.
        assert step.replacements == alike + step.zero_variance_replacements - trained_alike
        assert trained_alike <= alike
        assert (step.refill_rounds == 0) == (alike == 0)
        assert step.refill_rounds <= 4
        # Fewer than 4 rounds only when nothing was left to replace.
        assert step.refill_rounds == 4 or trained_alike == 0


def test_refill_grades_every_replacement_and_trains_on_each_positions_last_group(
    write_curriculum: WriteCurriculum, monkeypatch: pytest.MonkeyPatch
) -> None:
    curriculum = _ladder(write_curriculum, refill=ZERO_VARIANCE)
    population = population_from_curriculum(curriculum, seed=1, held_out=100)
    graded: list[GradeRow] = []
    learned: list[list[tuple[str, int]]] = []

    class SpyStore(Store):
        def insert_grades(self, rows: Sequence[GradeRow]) -> StoredGrades:
            graded.extend(rows)
            return super().insert_grades(rows)

    class SpyLearner(Learner):
        def learn(self, picks: Sequence[tuple[str, int]], rewards: np.typing.NDArray[np.float64]) -> None:
            learned.append(list(picks))
            super().learn(picks, rewards)

    monkeypatch.setattr(simulation, "Store", SpyStore)
    monkeypatch.setattr(simulation, "Learner", SpyLearner)

    result = simulate(curriculum, population, steps=60, batch_size=8, model=LearnerModel(group_size=4), lag=0)

    groups: dict[int, dict[int, list[GradeRow]]] = defaultdict(lambda: defaultdict(list))
    for row in graded:
        groups[row.key[0]][row.key[2]].append(row)
    assert sorted(groups) == list(range(60))  # lag 0: every iteration's grades are in, replacements included
    both = result.stages[1].first
    for step in result.steps:
        slots = groups[step.iteration]
        assert sorted(slots) == list(range(8 + step.replacements))
        assert all(len(rows) == 4 and {r.stage for r in rows} == {step.stage} for rows in slots.values())
        # The rounds again, from the grades alone: which groups scored alike, and the records that replace them.
        occupant = list(range(8))
        held: dict[str, set[int]] = defaultdict(set)
        for rows in (slots[n] for n in range(8)):
            held[rows[0].source].add(int(rows[0].key[1].rsplit(":", 1)[1]))
        positions, slot, rounds = list(range(8)), 8, 0
        for round_ in range(1, 5) if step.iteration >= both else ():
            positions = [p for p in positions if len({r.reward for r in slots[occupant[p]]}) == 1]
            if not positions:
                break
            rounds += 1
            for p in positions:
                source = slots[occupant[p]][0].source
                key = replacement_key(curriculum.seed, source, 40, step.iteration, round_, p, held[source])
                held[source].add(key)
                assert slots[slot][0].source == source
                assert slots[slot][0].key[1] == curriculum.sources[source].sample_id(key)
                occupant[p], slot = slot, slot + 1
        assert (rounds, slot) == (step.refill_rounds, 8 + step.replacements)
        last = [slots[n][0] for n in occupant]
        assert learned[step.iteration] == [(row.source, int(row.key[1].rsplit(":", 1)[1])) for row in last]
    assert sum(s.replacements for s in result.steps[both:]) > 0


def test_a_run_with_refill_is_a_function_of_its_seed(write_curriculum: WriteCurriculum) -> None:
    curriculum = _ladder(write_curriculum, {"kind": "learnability"}, refill=ZERO_VARIANCE)
    population = population_from_curriculum(curriculum, seed=1, held_out=100)

    first = simulate(curriculum, population, steps=50, batch_size=8, seed=7)
    again = simulate(curriculum, population, steps=50, batch_size=8, seed=7)
    other = simulate(curriculum, population, steps=50, batch_size=8, seed=8)

    assert first.replacements > 0
    assert first.steps == again.steps and first.stages == again.stages and first.skills == again.skills
    assert first.steps != other.steps


def test_a_stage_without_refill_runs_as_it_did(write_curriculum: WriteCurriculum) -> None:
    # Only the second stage refills: the first runs exactly as without any rule, step for step.
    plain_curriculum = _ladder(write_curriculum)
    refill_curriculum = _ladder(write_curriculum, refill=ZERO_VARIANCE)
    population = population_from_curriculum(plain_curriculum, seed=1, held_out=100)

    plain = simulate(plain_curriculum, population, steps=60, batch_size=8)
    refill = simulate(refill_curriculum, population, steps=60, batch_size=8)

    warm = refill.stages[0].stop
    assert warm == plain.stages[0].stop and 0 < warm < 60
    assert refill.steps[:warm] == plain.steps[:warm]
    assert refill.transitions == plain.transitions
    assert all(s.refill_rounds == 0 and s.trained_zero_variance == s.zero_variance for s in refill.steps[:warm])
    assert refill.steps[warm:] != plain.steps[warm:]
