"""Tests for learning-progress mixing (:mod:`proctor.server.curriculum.learning_progress`), alone and as the
curriculum's progress draws with it."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.learning_progress import GroupSignal, LearningProgressMix, group_signal
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.mixing import Mixer
from proctor.server.curriculum.progress import CurriculumProgress
from proctor.server.curriculum.samplers import SamplerState
from proctor.server.spec import LearningProgressParams
from proctor.server.state.items import NEW_GROUP, GroupState
from proctor.server.state.rows import GradeRow, GroupChange, StoredGrades
from tests.server.curriculum.conftest import WriteCurriculum

SOURCES = ("easy", "mid", "hard")


def state_of(rewards: list[float]) -> GroupState:
    group = NEW_GROUP
    for r in rewards:
        group = group.add(r)
    return group


def mix(floor: float = 0.05, temperature: float = 0.1, window: int = 8) -> LearningProgressMix:
    params = LearningProgressParams(floor=floor, temperature=temperature, window=window)
    return LearningProgressMix(0, [(s, 1 / len(SOURCES)) for s in SOURCES], params)


def groups(source: str, iteration: int, rewards: list[list[float]]) -> list[GroupSignal]:
    return [
        GroupSignal((iteration, f"{source}:0123456789:{slot}", slot), source, state_of(r))
        for slot, r in enumerate(rewards)
    ]


def test_a_group_teaches_by_its_advantage() -> None:
    assert group_signal(state_of([1.0])) is None  # one completion has no advantage yet
    assert group_signal(state_of([1.0, 1.0, 1.0])) == 0.0
    assert group_signal(state_of([0.0, 0.0])) == 0.0
    assert group_signal(state_of([0.0, 1.0, 0.0, 1.0])) == pytest.approx(1.0)  # GRPO's mean |A| for 0/1 rewards
    assert group_signal(state_of([0.0, 0.0, 0.0, 1.0])) == pytest.approx(2 * (0.25 * 0.75) ** 0.5)


def test_with_no_signal_the_stage_serves_its_own_mix_above_the_floor() -> None:
    params = LearningProgressParams(floor=0.05)
    m = LearningProgressMix(0, [("easy", 0.5), ("mid", 0.3), ("hard", 0.2)], params)
    assert m.weights() == pytest.approx(
        {"easy": 0.05 + 0.85 * 0.5, "mid": 0.05 + 0.85 * 0.3, "hard": 0.05 + 0.85 * 0.2}
    )
    assert m.signals() == {"easy": None, "mid": None, "hard": None}


def test_the_weight_moves_to_the_source_that_teaches_and_keeps_the_floor() -> None:
    m = mix(floor=0.05)
    m.observe(groups("easy", 0, [[1.0] * 4] * 8))  # mastered: nothing left to learn
    m.observe(groups("mid", 0, [[0.0, 1.0, 0.0, 1.0]] * 8))  # half right: the most to learn from
    m.observe(groups("hard", 0, [[0.0] * 4] * 8))  # never right: no advantage
    signals = m.signals()
    assert signals["easy"] == 0.0 and signals["hard"] == 0.0
    assert signals["mid"] == pytest.approx(0.5)  # mean |A| 1, times the half still to learn
    weights = m.weights()
    # A tenth of the best signal is a weight e^(-(1 - 0.1) / τ) of the best's: nothing to learn is e^(-10).
    assert weights["easy"] == pytest.approx(0.05, abs=1e-4) and weights["hard"] == pytest.approx(0.05, abs=1e-4)
    assert weights["mid"] == pytest.approx(0.9, abs=1e-4)


def test_a_source_without_grades_is_tried_first() -> None:
    m = mix()
    m.observe(groups("easy", 0, [[0.0, 1.0]] * 4))
    m.observe(groups("mid", 0, [[0.0, 0.0, 0.0, 1.0]] * 4))
    signals = m.signals()
    assert signals["easy"] == pytest.approx(0.5) and signals["mid"] == pytest.approx(0.75**1.5)
    weights = m.weights()
    assert weights["hard"] == pytest.approx(weights["mid"])  # unseen counts as the best seen
    assert weights["easy"] < weights["mid"]


def test_the_window_holds_the_latest_groups_whatever_order_they_arrived_in() -> None:
    arrivals = [g for it in range(6) for g in groups("mid", it, [[0.0, 1.0], [1.0, 1.0], [0.0, 0.0, 1.0]])]
    first = mix(window=5)
    first.observe(arrivals)
    shuffled = arrivals[:]
    random.Random(3).shuffle(shuffled)
    second = mix(window=5)
    second.observe(shuffled)
    assert first.signals() == second.signals()
    # A group's later grades replace its numbers rather than adding a group.
    late = GroupSignal(arrivals[-1].key, "mid", state_of([0.0, 0.0, 1.0, 1.0]))
    first.observe([late])
    second.observe([late])
    assert first.signals() == second.signals()


@settings(max_examples=200, deadline=None)
@given(
    signals=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    floor=st.sampled_from([0.0, 0.01, 0.05, 0.2, 1 / 3]),
    batches=st.lists(st.integers(1, 64), min_size=1, max_size=40),
)
def test_quotas_fill_the_batch_exactly_and_every_source_gets_its_floor(
    signals: list[float], floor: float, batches: list[int]
) -> None:
    m = mix(floor=floor, temperature=0.05)
    for source, signal in zip(SOURCES, signals, strict=True):
        # A group of 0/1 rewards whose signal (2σ × (1 − p)) is as drawn is not always possible: draw its pass rate.
        p = min(0.999, max(0.001, signal))
        m.observe([GroupSignal((0, f"{source}:0123456789:0", 0), source, GroupState(2, p, 2 * p * (1 - p)))])
    weights = m.weights()
    assert sum(weights.values()) == pytest.approx(1.0)
    assert all(w >= floor - 1e-12 for w in weights.values())
    credits: dict[str, float] = {}
    served: Counter[str] = Counter()
    for iteration, size in enumerate(batches):
        quotas = m.quotas(weights, size, credits, iteration)
        assert [s for s, _ in quotas] == list(SOURCES)
        assert sum(q for _, q in quotas) == size and all(q >= 0 for _, q in quotas)
        served.update(dict(quotas))
    total = sum(batches)
    for source in SOURCES:
        # Within a prompt or two of what the weights owe, however small the batches.
        assert abs(served[source] - weights[source] * total) < 2


WINDOW = 16
ROWS = 40


def lp_curriculum(write_curriculum: WriteCurriculum, sampler: str = "uniform") -> Curriculum:
    files = {
        f"{s}.jsonl": "".join(json.dumps({"prompt": f"{s} {i}", "answer": "1"}) + "\n" for i in range(ROWS))
        for s in SOURCES
    }
    doc: dict[str, Any] = {
        "name": "lp",
        "seed": 4,
        "sources": {s: {"path": f"{s}.jsonl", "graders": ["exact_match"]} for s in SOURCES},
        "stages": [
            {
                "name": "all",
                "until_step": 1000,
                "mix": [{"source": s} for s in SOURCES],
                "sampler": {"kind": sampler},
                "mixing": {"kind": "learning_progress", "params": {"window": WINDOW, "floor": 0.1}},
            }
        ],
    }
    return load_curriculum(write_curriculum(doc, files=files))


PASS = {"easy": 0.97, "mid": 0.5, "hard": 0.02}
GroupRow = tuple[int, str, int, GroupState]


def grade(
    progress: CurriculumProgress, cur: Curriculum, iteration: int, picks: list[tuple[str, int]]
) -> list[GroupRow]:
    """Four completions of each pick, right with the source's chance, folded in as the store folds them; returns
    the groups as the state file keeps them."""
    rng = random.Random(f"grades {iteration}")
    rows: list[GradeRow] = []
    changes: list[GroupChange] = []
    for slot, (source, key) in enumerate(picks):
        sid = cur.sources[source].sample_id(key)
        rewards = [float(rng.random() < PASS[source]) for _ in range(4)]
        rows += [GradeRow((iteration, sid, slot, j, f"{j}"), 0, source, r, {}, None) for j, r in enumerate(rewards)]
        changes.append(GroupChange(iteration, sid, slot, source, NEW_GROUP, state_of(rewards)))
    progress.graded(rows, StoredGrades(["inserted"] * len(rows), [], changes))
    return [(c.iteration, c.sample_id, c.slot, c.after) for c in changes]


def draw(progress: CurriculumProgress, mixer: Mixer, iteration: int, batch: int) -> list[tuple[str, int]]:
    d = progress.draw(iteration, batch, mixer)
    for _ in d.steps():
        pass
    assert d.decision is not None
    counts = Counter(s for s, _ in d.picks)
    assert d.decision.detail["mix"]["quotas"] == {s: counts[s] for s in SOURCES}
    return d.picks


@pytest.mark.parametrize("sampler", ["uniform", "learnability", "skip_zero_variance"])
def test_the_stage_moves_its_batches_to_the_source_that_teaches(
    write_curriculum: WriteCurriculum, sampler: str
) -> None:
    cur = lp_curriculum(write_curriculum, sampler)
    progress, mixer = CurriculumProgress.start(cur), Mixer(cur)
    served: Counter[str] = Counter()
    for iteration in range(30):
        picks = draw(progress, mixer, iteration, 12)
        if iteration >= 10:
            served.update(s for s, _ in picks)
        # Within a batch no record comes twice (each source has more rows than its quota).
        assert len(set(picks)) == len(picks)
        grade(progress, cur, iteration, picks)
    assert served["mid"] > served["easy"] and served["mid"] > served["hard"]
    assert min(served.values()) >= 0.1 * 20 * 12 - 2  # the floor
    weights = progress.adaptive.mixes[0].weights()
    assert max(weights, key=lambda s: weights[s]) == "mid"


@pytest.mark.parametrize("sampler", ["uniform", "learnability"])
def test_a_restart_from_the_recorded_state_draws_what_the_first_would_have(
    write_curriculum: WriteCurriculum, sampler: str
) -> None:
    cur = lp_curriculum(write_curriculum, sampler)
    first, mixer = CurriculumProgress.start(cur), Mixer(cur)
    stored: dict[tuple[int, str, int], GroupState] = {}
    recorded: dict[str, Any] = {}
    for iteration in range(9):
        d = first.draw(iteration, 10, mixer)
        for _ in d.steps():
            pass
        assert d.decision is not None
        recorded = d.decision.state
        stored.update({(i, sid, slot): g for i, sid, slot, g in grade(first, cur, iteration, d.picks)})
    # What a restart reads back: the latest decision's sampler state, the records' state, the latest groups.
    restarted = CurriculumProgress.start(
        cur, last_iteration=8, sampler_state=SamplerState.from_json(json.loads(json.dumps(recorded)))
    )
    for source in first.adaptive.items.sizes:
        items = first.adaptive.items
        restarted.adaptive.items.restore(
            source,
            [
                (
                    k,
                    float(items.passes[source][k]),
                    float(items.fails[source][k]),
                    int(items.groups[source][k]),
                    int(items.streak[source][k]),
                    int(items.served_epoch[source][k]),
                )
                for k in range(items.sizes[source])
            ],
        )
    restarted.adaptive.restore_mixes([(*key, g) for key, g in sorted(stored.items())])
    assert restarted.adaptive.mixes[0].weights() == first.adaptive.mixes[0].weights()
    for iteration in range(9, 15):
        a = draw(first, mixer, iteration, 10)
        b = draw(restarted, Mixer(cur), iteration, 10)
        assert a == b
        grade(first, cur, iteration, a)
        grade(restarted, cur, iteration, b)


def test_a_gate_ends_a_learning_progress_stage(write_curriculum: WriteCurriculum) -> None:
    files = {
        f"{s}.jsonl": "".join(json.dumps({"prompt": f"{s} {i}", "answer": "1"}) + "\n" for i in range(ROWS))
        for s in SOURCES
    }
    mix = [{"source": s} for s in SOURCES]
    doc: dict[str, Any] = {
        "name": "lp_gated",
        "sources": {s: {"path": f"{s}.jsonl", "graders": ["exact_match"]} for s in SOURCES},
        "stages": [
            {
                "name": "mixed",
                "until_step": 100,
                "mix": mix,
                "mixing": {"kind": "learning_progress"},
                "advance": {"threshold": 0.3, "window": 32, "min_steps": 3},
            },
            {"name": "after", "until_step": 200, "mix": [{"source": "easy"}]},
        ],
    }
    cur = load_curriculum(write_curriculum(doc, files=files))
    progress, mixer = CurriculumProgress.start(cur), Mixer(cur)
    stages = []
    for iteration in range(8):
        d = progress.draw(iteration, 12, mixer)
        for _ in d.steps():
            pass
        stages.append(d.stage)
        assert (d.decision is not None) == (d.stage == 0)  # a fixed, uniform stage decides nothing to record
        grade(progress, cur, iteration, d.picks)
    # Mean reward about (0.97 + 0.5 + 0.02) / 3 ≈ 0.5 ≥ 0.3: the gate fires once min_steps have passed.
    assert stages[:3] == [0, 0, 0] and stages[-1] == 1
    [transition] = progress.schedule.transitions
    assert transition.reason.startswith("gate: mean reward")
