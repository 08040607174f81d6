"""Tests for the adaptive samplers (:mod:`proctor.server.curriculum.samplers`), driven as the sampling service
drives them: through :class:`AdaptiveSampling` over a loaded curriculum."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.adaptive import AdaptiveSampling, finite_sizes
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.samplers import (
    LearnabilitySampler,
    SamplerState,
    SkipZeroVarianceSampler,
    StageFeedback,
    TargetDifficultySampler,
)
from proctor.server.curriculum.sumtree import quantize
from proctor.server.state.items import ItemState, ItemStatistics

WriteCurriculum = Callable[..., Path]
NO_FEEDBACK = StageFeedback(None, 0)


def curriculum(write: WriteCurriculum, sampler: dict[str, Any], *, rows: int = 30, sources: int = 1) -> Curriculum:
    files = {
        f"s{n}.jsonl": "".join(
            json.dumps({"prompt": f"q{n}-{i}", "answer": "a", "level": i % 7}) + "\n" for i in range(rows)
        )
        for n in range(sources)
    }
    doc = {
        "name": "adaptive",
        "seed": 11,
        "sources": {
            f"s{n}": {"path": f"s{n}.jsonl", "graders": ["exact_match"], "difficulty_field": "level", "difficulty": n}
            for n in range(sources)
        },
        "stages": [
            {
                "name": "only",
                "until_step": 10_000,
                "mix": [{"source": f"s{n}"} for n in range(sources)],
                "sampler": sampler,
            }
        ],
    }
    return load_curriculum(write(doc, files=files))


class Run:
    """An :class:`AdaptiveSampling` with its per-record state, drawing iterations like the sampling service."""

    def __init__(self, cur: Curriculum, items: ItemStatistics | None = None, state: SamplerState | None = None) -> None:
        self.cur = cur
        self.items = items or ItemStatistics(finite_sizes(cur))
        self.adaptive = AdaptiveSampling(cur, self.items, state or SamplerState())
        self.details: list[dict[str, Any]] = []

    def draw(self, iteration: int, count: int, feedback: StageFeedback = NO_FEEDBACK) -> list[tuple[str, int]]:
        sampler = self.adaptive.sampler(0)
        assert sampler is not None
        sources = [s for s, _ in self.cur.stages[0].mix]
        quotas = [(s, count // len(sources) + (n < count % len(sources))) for n, s in enumerate(sources)]
        decision, parts = self.adaptive.draw(sampler, iteration, quotas, feedback)
        picks = [p for part in parts for p in part]
        self.details.append(decision.detail)
        return picks

    def snapshot(self) -> Run:
        """A fresh run from what the state file would hold now: per-record state and sampler state."""
        items = ItemStatistics(self.items.sizes)
        for source in self.items.sizes:
            items.restore(
                source,
                [
                    (
                        k,
                        float(self.items.passes[source][k]),
                        float(self.items.fails[source][k]),
                        int(self.items.groups[source][k]),
                        int(self.items.streak[source][k]),
                        int(self.items.served_epoch[source][k]),
                    )
                    for k in range(self.items.sizes[source])
                ],
            )
        return Run(self.cur, items, SamplerState.from_json(json.loads(json.dumps(self.adaptive.state.to_json()))))

    def grade(self, source: str, key: int, passes: float, fails: float, streak: int = 0) -> None:
        self.adaptive.graded([(source, key, ItemState(passes, fails, 1, streak))])


SAMPLERS = [
    {"kind": "learnability"},
    {"kind": "learnability", "params": {"explore": 0.0, "epoch_mass": 0.0}},
    {"kind": "target_difficulty"},
    {"kind": "target_difficulty", "params": {"difficulty": "record", "epoch_mass": 0.3}},
    {"kind": "target_difficulty", "params": {"difficulty": "source"}},
    {"kind": "skip_zero_variance", "params": {"min_streak": 1, "skip_probability": 0.9, "max_skip": 0.95}},
]
IDS = ["learnability", "learnability-greedy", "target-pass-rate", "target-record", "target-source", "skip"]

grades = st.lists(st.tuples(st.integers(0, 29), st.integers(0, 8), st.integers(0, 8), st.integers(0, 4)), max_size=40)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=IDS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    history=grades,
    count=st.integers(1, 12),
    split=st.integers(1, 8),
)
def test_a_restarted_server_chooses_what_the_first_would_have(
    write_curriculum: WriteCurriculum,
    sampler: dict[str, Any],
    history: list[tuple[int, int, int, int]],
    count: int,
    split: int,
) -> None:
    cur = curriculum(write_curriculum, sampler, sources=2)
    first = Run(cur)
    for iteration in range(split):
        first.draw(iteration, count, StageFeedback(0.2 * (iteration % 5), iteration))
        for key, p, f, streak in history[iteration::split]:
            first.grade("s0", key, p, f, streak)
    restarted = first.snapshot()
    for iteration in range(split, split + 6):
        feedback = StageFeedback(0.9, 100 + iteration)
        assert restarted.draw(iteration, count, feedback) == first.draw(iteration, count, feedback)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=IDS)
def test_the_same_state_draws_the_same_batch(write_curriculum: WriteCurriculum, sampler: dict[str, Any]) -> None:
    cur = curriculum(write_curriculum, sampler)
    a, b = Run(cur), Run(cur)
    for iteration in range(20):
        assert a.draw(iteration, 7) == b.draw(iteration, 7)


@pytest.mark.parametrize("sampler", SAMPLERS[:5], ids=IDS[:5])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=grades, count=st.integers(1, 29), iterations=st.integers(1, 25))
def test_no_record_twice_within_an_epoch(
    write_curriculum: WriteCurriculum,
    sampler: dict[str, Any],
    history: list[tuple[int, int, int, int]],
    count: int,
    iterations: int,
) -> None:
    cur = curriculum(write_curriculum, sampler)
    run = Run(cur)
    for key, p, f, streak in history:
        run.grade("s0", key, p, f, streak)
    served: dict[int, list[int]] = {}
    for iteration in range(iterations):
        picks = run.draw(iteration, count)
        assert len({k for _, k in picks}) == len(picks), "a record twice in one batch"
        for _, key in picks:
            served.setdefault(int(run.items.served_epoch["s0"][key]), []).append(key)
    for epoch, keys in served.items():
        assert len(keys) == len(set(keys)), (
            f"epoch {epoch} served {sorted(k for k, n in Counter(keys).items() if n > 1)} twice"
        )


def test_a_batch_larger_than_the_source_repeats_only_what_it_must(write_curriculum: WriteCurriculum) -> None:
    run = Run(curriculum(write_curriculum, {"kind": "learnability"}, rows=5))
    picks = run.draw(0, 12)
    assert len(picks) == 12
    assert set(Counter(k for _, k in picks).values()) <= {2, 3}


@given(
    passes=st.lists(st.floats(0, 50), min_size=30, max_size=30),
    fails=st.lists(st.floats(0, 50), min_size=30, max_size=30),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_learnability_weights_follow_the_posterior(
    write_curriculum: WriteCurriculum, passes: list[float], fails: list[float]
) -> None:
    run = Run(curriculum(write_curriculum, {"kind": "learnability", "params": {"explore": 0.1, "prior": [1, 1]}}))
    for key, (p, f) in enumerate(zip(passes, fails, strict=True)):
        run.grade("s0", key, p, f)
    sampler = run.adaptive.sampler(0)
    assert isinstance(sampler, LearnabilitySampler)
    phat = (np.array(passes) + 1) / (np.array(passes) + np.array(fails) + 2)
    expected = quantize(0.1 + 0.9 * 4 * phat * (1 - phat))
    assert sampler.weights("s0").tolist() == expected.tolist()
    # More learnable, more weight: the order of the weights is the order of p̂(1 − p̂).
    order = np.argsort(phat * (1 - phat), kind="stable")
    assert np.all(np.diff(sampler.weights("s0")[order]) >= 0)


def test_learnability_draws_in_proportion_to_the_weights(write_curriculum: WriteCurriculum) -> None:
    """The first record of a fresh epoch, over many iterations: its frequency follows the weights."""
    cur = curriculum(write_curriculum, {"kind": "learnability", "params": {"explore": 0.0}}, rows=4)
    run = Run(cur)
    for key, (p, f) in enumerate([(5, 5), (9, 1), (1, 9), (0, 50)]):
        run.grade("s0", key, p, f)
    sampler = run.adaptive.sampler(0)
    assert isinstance(sampler, LearnabilitySampler)
    weights = sampler.weights("s0").astype(float)
    firsts: Counter[int] = Counter()
    for iteration in range(4000):
        fresh = Run(cur, run.snapshot().items, SamplerState())
        firsts[fresh.draw(iteration, 1)[0][1]] += 1
    expected = 4000 * weights / weights.sum()
    chi2 = sum((firsts[k] - expected[k]) ** 2 / expected[k] for k in range(4) if expected[k] > 0)
    assert chi2 < 16.3  # p = 0.001 at 3 degrees of freedom; seeded, so the outcome is fixed
    assert firsts[3] < 0.05 * 4000  # a record failed 50 times out of 50 is nearly never drawn


def test_an_epoch_ends_once_the_unserved_weight_falls_below_epoch_mass(write_curriculum: WriteCurriculum) -> None:
    run = Run(curriculum(write_curriculum, {"kind": "learnability", "params": {"epoch_mass": 0.5}}, rows=30))
    epochs = []
    for iteration in range(6):
        run.draw(iteration, 5)
        epochs.append(run.details[-1]["epochs"]["s0"])
    # Equal weights: an epoch serves 15 records (half the mass), so three batches of 5 per epoch.
    assert epochs == [0, 0, 0, 1, 1, 1]


def test_skipping_grows_with_the_streak_and_is_capped(write_curriculum: WriteCurriculum) -> None:
    params = {"min_streak": 2, "skip_probability": 0.5, "max_skip": 0.8}
    sampler = Run(curriculum(write_curriculum, {"kind": "skip_zero_variance", "params": params})).adaptive.sampler(0)
    assert isinstance(sampler, SkipZeroVarianceSampler)
    probabilities = [sampler.skip_probability(streak) for streak in range(7)]
    assert probabilities[:2] == [0.0, 0.0]
    assert probabilities[2] == 0.5 and probabilities[3] == 0.75
    assert probabilities[4:] == [0.8, 0.8, 0.8]


def test_skip_zero_variance_skips_settled_records_and_brings_them_back(write_curriculum: WriteCurriculum) -> None:
    params = {"min_streak": 1, "skip_probability": 0.9, "max_skip": 0.9}
    run = Run(curriculum(write_curriculum, {"kind": "skip_zero_variance", "params": params}, rows=30))
    settled = set(range(20))
    for key in settled:
        run.grade("s0", key, 8, 0, streak=5)
    counts = Counter(k for iteration in range(60) for _, k in run.draw(iteration, 5))
    live = sum(counts[k] for k in range(20, 30)) / 10
    skipped = sum(counts[k] for k in settled) / 20
    assert skipped < live / 3
    assert all(counts[k] > 0 for k in settled), "a skipped record must come back in a later epoch"
    assert sum(d["skipped"]["s0"] for d in run.details) > 0


def test_the_target_moves_with_the_reward_and_stays_on_zero_one(write_curriculum: WriteCurriculum) -> None:
    params = {"initial_target": 0.5, "step": 0.2, "sensitivity": 4.0, "target_reward": 0.5}
    run = Run(curriculum(write_curriculum, {"kind": "target_difficulty", "params": params}))
    targets = []
    for iteration, reward in enumerate([0.9, 0.9, 0.9, 0.9, 0.1]):
        run.draw(iteration, 3, StageFeedback(reward, 10 * (iteration + 1)))
        targets.append(run.details[-1]["target"])
    assert targets[0] == pytest.approx(0.5 + 0.2 * math.tanh(4 * 0.4))
    assert targets[1] > targets[0] and targets[3] == 1.0
    assert targets[4] < targets[3]
    # No new grades since the last decision: the target stays put.
    run.draw(5, 3, StageFeedback(0.1, 50))
    assert run.details[-1]["target"] == targets[4]


def test_target_difficulty_serves_records_near_the_target(write_curriculum: WriteCurriculum) -> None:
    params = {"difficulty": "record", "initial_target": 0.0, "width": 0.05, "explore": 0.0, "epoch_mass": 0.0}
    run = Run(curriculum(write_curriculum, {"kind": "target_difficulty", "params": params}, rows=70))
    sampler = run.adaptive.sampler(0)
    assert isinstance(sampler, TargetDifficultySampler)
    picks = run.draw(0, 10)
    levels = [k % 7 for _, k in picks]
    assert levels == [0] * 10  # level 0 of 0..6 is difficulty 0.0: ten records there, served first


def every_stage(feedback: StageFeedback) -> Callable[[int], StageFeedback]:
    """The ``feedback(stage)`` that :meth:`AdaptiveSampling.prepare` reads: ``feedback``, whatever the stage."""
    return lambda stage: feedback


@pytest.mark.parametrize("difficulty", ["pass_rate", "record"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=grades, rewards=st.lists(st.floats(0, 1), min_size=8, max_size=8))
def test_preparing_the_next_target_after_grades_changes_no_draw(
    write_curriculum: WriteCurriculum, difficulty: str, history: list[tuple[int, int, int, int]], rewards: list[float]
) -> None:
    """The target's trees rebuilt after a /grade (prepare) rather than in the next /sample: the same batches, the
    same weights, whether or not more grades arrived in between."""
    params = {"difficulty": difficulty, "step": 0.2, "width": 0.05}
    cur = curriculum(write_curriculum, {"kind": "target_difficulty", "params": params}, sources=2)
    eager, lazy = Run(cur), Run(cur)
    for iteration, reward in enumerate(rewards):
        feedback = StageFeedback(reward, 10 * (iteration + 1))
        assert eager.draw(iteration, 6, feedback) == lazy.draw(iteration, 6, feedback)
        for run in (eager, lazy):
            for key, p, f, streak in history[iteration::8]:
                run.grade("s0", key, p, f, streak)
        sampler = eager.adaptive.sampler(0)
        assert isinstance(sampler, TargetDifficultySampler)
        # As the grading path does: the feedback the next iteration reads, prepared for now.
        next_feedback = StageFeedback(rewards[(iteration + 1) % len(rewards)], 10 * (iteration + 2))
        eager.adaptive.prepare(every_stage(next_feedback))
        if iteration % 3 == 0:  # and sometimes grades arrive after the preparation
            for run in (eager, lazy):
                run.grade("s1", iteration % 30, 2, 1)
    last = StageFeedback(rewards[0], 10 * (len(rewards) + 1))  # the iteration the last preparation was for
    assert eager.draw(len(rewards), 6, last) == lazy.draw(len(rewards), 6, last)
    for source in ("s0", "s1"):
        eager_sampler, lazy_sampler = eager.adaptive.sampler(0), lazy.adaptive.sampler(0)
        assert isinstance(eager_sampler, TargetDifficultySampler)
        assert isinstance(lazy_sampler, TargetDifficultySampler)
        assert eager_sampler.weights(source).tolist() == lazy_sampler.weights(source).tolist()


def test_target_difficulty_weights_are_the_same_for_every_record_at_once_or_one_by_one(
    write_curriculum: WriteCurriculum,
) -> None:
    run = Run(curriculum(write_curriculum, {"kind": "target_difficulty"}, rows=30))
    for key in range(30):
        run.grade("s0", key, key % 7, key % 5)
    run.draw(0, 4, StageFeedback(0.8, 100))
    sampler = run.adaptive.sampler(0)
    assert isinstance(sampler, TargetDifficultySampler)
    every = sampler.weights("s0")
    one_by_one = [int(sampler.weights("s0", np.array([k], dtype=np.int64))[0]) for k in range(30)]
    assert every.tolist() == one_by_one
