"""Tests for stage decisions in :mod:`proctor.server.curriculum.engine`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.engine import GateView, StageSchedule
from proctor.server.curriculum.loader import Stage
from proctor.server.spec import AdvanceGate
from proctor.server.state.rows import TransitionRecord


def stage(index: int, until_step: int, advance: AdvanceGate | None = None) -> Stage:
    return Stage(index=index, name=f"s{index}", until_step=until_step, mix=(("x", 1.0),), replay=0.0, advance=advance)


def stages(*untils: int, gates: dict[int, AdvanceGate] | None = None) -> list[Stage]:
    gates = gates or {}
    return [stage(i, u, gates.get(i)) for i, u in enumerate(untils)]


def gate_of(mean: float | None, count: int) -> GateView:
    return lambda _stage: (mean, count)


NEVER = gate_of(None, 0)
GATE = AdvanceGate(threshold=0.8, window=4, min_steps=5)


# --- stage_of ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("iteration", "expected"),
    [(0, 0), (9, 0), (10, 1), (19, 1), (20, 2), (29, 2), (30, 2), (10**9, 2)],
    ids=str,
)
def test_stage_of_follows_the_until_step_caps(iteration: int, expected: int) -> None:
    assert StageSchedule(stages(10, 20, 30)).stage_of(iteration) == expected


def test_stage_of_a_single_stage_is_always_zero() -> None:
    schedule = StageSchedule(stages(5))
    assert [schedule.stage_of(i) for i in (0, 4, 5, 1000)] == [0, 0, 0, 0]


def test_stage_of_uses_recorded_transitions_then_caps() -> None:
    schedule = StageSchedule(
        stages(10, 20, 30, 40), [TransitionRecord(4, 0, 1, "gate"), TransitionRecord(7, 1, 2, "gate")]
    )
    got = [schedule.stage_of(i) for i in range(0, 45, 1)]
    assert got == [0] * 4 + [1] * 3 + [2] * 23 + [3] * 15
    assert (schedule.current, schedule.current_start) == (2, 7)


def test_empty_schedule_starts_at_stage_zero() -> None:
    schedule = StageSchedule(stages(10, 20))
    assert (schedule.current, schedule.current_start, schedule.transitions) == (0, 0, [])


# --- decide: caps -----------------------------------------------------------------------------------------


def test_decide_inside_the_first_stage_is_nothing() -> None:
    assert StageSchedule(stages(10, 20, 30)).decide(9, NEVER) == []


@pytest.mark.parametrize(
    ("iteration", "expected"),
    [
        (10, [(10, 0, 1)]),
        (15, [(10, 0, 1)]),
        (20, [(10, 0, 1), (20, 1, 2)]),
        (25, [(10, 0, 1), (20, 1, 2)]),
        (35, [(10, 0, 1), (20, 1, 2), (30, 2, 3)]),
        (10**6, [(10, 0, 1), (20, 1, 2), (30, 2, 3)]),
    ],
    ids=["at-cap", "past-one", "at-second-cap", "past-two", "past-three", "far-beyond"],
)
def test_decide_records_each_cap_at_its_until_step_in_order(
    iteration: int, expected: list[tuple[int, int, int]]
) -> None:
    records = StageSchedule(stages(10, 20, 30, 40)).decide(iteration, NEVER)
    assert [(t.iteration, t.from_stage, t.to_stage) for t in records] == expected
    assert [t.reason for t in records] == [f"reached until_step {t.iteration}" for t in records]
    assert all(t.rolling_reward is None and t.rolling_count is None for t in records)


def test_decide_starts_from_the_recorded_stage() -> None:
    schedule = StageSchedule(stages(10, 20, 30), [TransitionRecord(3, 0, 1, "gate")])
    assert schedule.decide(15, NEVER) == []
    assert [(t.iteration, t.from_stage, t.to_stage) for t in schedule.decide(22, NEVER)] == [(20, 1, 2)]


def test_decide_does_not_change_the_schedule() -> None:
    schedule = StageSchedule(stages(10, 20, 30))
    schedule.decide(25, NEVER)
    assert schedule.transitions == []
    assert schedule.current == 0


# --- decide: gates ----------------------------------------------------------------------------------------


def test_gate_fires_at_the_boundary_values() -> None:
    # count == window, mean == threshold, iteration - start == min_steps: all inclusive.
    [record] = StageSchedule(stages(100, 200, gates={0: GATE})).decide(5, gate_of(0.8, 4))
    assert (record.iteration, record.from_stage, record.to_stage) == (5, 0, 1)
    assert (record.rolling_reward, record.rolling_count) == (0.8, 4)


@pytest.mark.parametrize(
    ("iteration", "mean", "count"),
    [
        (4, 0.95, 100),  # min_steps not reached
        (50, 0.79, 100),  # mean below threshold
        (50, 0.95, 3),  # window not full
        (50, None, 0),  # nothing graded yet
        (50, None, 100),  # no mean even with a count
        (4, 0.79, 3),  # all three short
        (4, 0.95, 3),  # only the mean is there
        (50, 0.0, 0),  # a zero mean over nothing
    ],
    ids=["min-steps", "mean", "window", "nothing", "no-mean", "all-short", "only-mean", "empty"],
)
def test_gate_needs_window_threshold_and_min_steps(iteration: int, mean: float | None, count: int) -> None:
    assert StageSchedule(stages(100, 200, gates={0: GATE})).decide(iteration, gate_of(mean, count)) == []


def test_gate_reason_mentions_mean_and_threshold() -> None:
    [record] = StageSchedule(stages(100, 200, gates={0: GATE})).decide(12, gate_of(0.9123, 64))
    assert "0.912" in record.reason
    assert "0.8" in record.reason
    assert "64" in record.reason
    assert record.reason.startswith("gate: mean reward 0.912 ≥ 0.8")


def test_gate_is_asked_about_the_stage_it_guards() -> None:
    asked: list[int] = []

    def gate(s: int) -> tuple[float | None, int]:
        asked.append(s)
        return 1.0, 100

    schedule = StageSchedule(stages(10, 100, 200, gates={1: GATE}))
    records = schedule.decide(50, gate)
    assert asked == [1]
    assert [(t.iteration, t.from_stage, t.to_stage) for t in records] == [(10, 0, 1), (50, 1, 2)]


def test_stage_without_gate_does_not_ask() -> None:
    def gate(_s: int) -> tuple[float | None, int]:
        raise AssertionError("asked a stage without a gate")

    assert StageSchedule(stages(10, 20)).decide(5, gate) == []


def test_min_steps_count_from_the_start_of_the_stage_after_a_cap() -> None:
    schedule = StageSchedule(stages(10, 100, 200, gates={1: GATE}))
    good = gate_of(1.0, 100)
    assert [(t.iteration, t.to_stage) for t in schedule.decide(14, good)] == [(10, 1)]
    assert [(t.iteration, t.to_stage) for t in schedule.decide(15, good)] == [(10, 1), (15, 2)]


def test_min_steps_count_from_a_recorded_gate_transition() -> None:
    schedule = StageSchedule(stages(100, 200, 300, gates={1: GATE}), [TransitionRecord(30, 0, 1, "gate")])
    good = gate_of(1.0, 100)
    assert schedule.decide(34, good) == []
    assert [(t.iteration, t.from_stage, t.to_stage) for t in schedule.decide(35, good)] == [(35, 1, 2)]


def test_gate_on_the_last_stage_never_fires() -> None:
    schedule = StageSchedule(stages(10, 20, gates={1: GATE}), [TransitionRecord(10, 0, 1, "reached until_step 10")])
    assert schedule.decide(500, gate_of(1.0, 10**6)) == []


def test_no_gate_after_the_caps_reach_the_last_stage() -> None:
    schedule = StageSchedule(stages(10, 20, gates={0: GATE}))
    records = schedule.decide(50, gate_of(1.0, 100))
    assert [(t.iteration, t.from_stage, t.to_stage) for t in records] == [(10, 0, 1)]


# --- apply ------------------------------------------------------------------------------------------------


def test_apply_keeps_earlier_iterations_where_they_were() -> None:
    schedule = StageSchedule(stages(100, 200, 300, gates={0: GATE, 1: GATE}))
    before = [schedule.stage_of(i) for i in range(12)]
    records = schedule.decide(12, gate_of(1.0, 100))
    schedule.apply(records)
    assert [schedule.stage_of(i) for i in range(12)] == before == [0] * 12
    assert schedule.stage_of(12) == 1
    assert (schedule.current, schedule.current_start) == (1, 12)


@settings(max_examples=60, deadline=None)
@given(
    untils=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    gated=st.lists(st.booleans(), min_size=5, max_size=5),
    min_steps=st.integers(0, 6),
    steps=st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=25),
)
def test_apply_never_rewrites_the_past(
    untils: list[int], gated: list[bool], min_steps: int, steps: list[tuple[int, bool]]
) -> None:
    caps = [sum(untils[: i + 1]) for i in range(len(untils))]
    gate = AdvanceGate(threshold=0.5, window=1, min_steps=min_steps)
    schedule = StageSchedule(stages(*caps, gates={i: gate for i in range(len(caps)) if gated[i]}))
    iteration = 0
    for gap, passing in steps:
        frontier = iteration + gap
        past = [schedule.stage_of(i) for i in range(frontier)]
        records = schedule.decide(frontier, gate_of(0.9 if passing else 0.1, 1))
        schedule.apply(records)
        assert [schedule.stage_of(i) for i in range(frontier)] == past
        # Stages only move forward, one at a time, and the frontier sits where the records say.
        assert all(t.to_stage == t.from_stage + 1 for t in records)
        assert [t.iteration for t in schedule.transitions] == sorted(t.iteration for t in schedule.transitions)
        assert schedule.stage_of(frontier) == schedule.current
        assert schedule.decide(frontier, gate_of(0.1, 1)) == []
        iteration = frontier
    got = [schedule.stage_of(i) for i in range(iteration + 1)]
    assert got == sorted(got)


def test_apply_refuses_an_earlier_transition() -> None:
    schedule = StageSchedule(stages(10, 20, 30))
    schedule.apply([TransitionRecord(20, 0, 1, "gate")])
    with pytest.raises(ValueError, match="transition at 10 comes before the recorded one at 20"):
        schedule.apply([TransitionRecord(10, 1, 2, "gate")])
    assert [t.iteration for t in schedule.transitions] == [20]


def test_apply_refuses_an_out_of_order_batch() -> None:
    schedule = StageSchedule(stages(10, 20, 30))
    with pytest.raises(ValueError, match="transition at 5 comes before the recorded one at 15"):
        schedule.apply([TransitionRecord(15, 0, 1, "gate"), TransitionRecord(5, 1, 2, "gate")])


def test_apply_accepts_two_transitions_at_one_iteration() -> None:
    schedule = StageSchedule(stages(10, 20, 30, gates={1: GATE}))
    schedule.apply([TransitionRecord(10, 0, 1, "reached until_step 10"), TransitionRecord(10, 1, 2, "gate")])
    assert schedule.stage_of(10) == 2
    assert schedule.stage_of(9) == 0


def test_restored_schedule_decides_like_the_original() -> None:
    original = StageSchedule(stages(10, 50, 90, 130, gates={1: GATE}))
    original.apply(original.decide(12, NEVER))
    original.apply(original.decide(20, gate_of(1.0, 10)))
    assert [(t.iteration, t.from_stage, t.to_stage) for t in original.transitions] == [(10, 0, 1), (20, 1, 2)]
    restored = StageSchedule(original.stages, original.transitions)
    assert [restored.stage_of(i) for i in range(140)] == [original.stage_of(i) for i in range(140)]
    assert (
        restored.decide(95, NEVER)
        == original.decide(95, NEVER)
        == [TransitionRecord(90, 2, 3, "reached until_step 90")]
    )
