"""Tests for the per-record state in :mod:`proctor.server.state.items`, folded by the real state file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.server.state.items import GroupState, ItemStatistics, ItemTracking
from proctor.server.state.rows import GradeRow
from proctor.server.store import Store

SID = "qa:0123456789:{}"


def open_store(path: Path | str = ":memory:", *, decay: float = 0.5, threshold: float = 1.0) -> Store:
    store = Store(path)
    store.bind(curriculum="c", curriculum_hash="h", seed=0)
    store.track_items(ItemTracking({"qa": threshold, "gen": 1.0}, frozenset({"qa"}), decay))
    return store


def grade(iteration: int, key: int, index: int, reward: float, *, slot: int = 0, error: str | None = None) -> GradeRow:
    sid = SID.format(key)
    return GradeRow((iteration, sid, slot, index, f"sha{index}"), 0, "qa", reward, {}, error)


def state_of(store: Store, key: int) -> tuple[float, float, int, int]:
    items = ItemStatistics({"qa": 10})
    items.restore("qa", store.item_rows("qa"))
    return (
        float(items.passes["qa"][key]),
        float(items.fails["qa"][key]),
        int(items.groups["qa"][key]),
        int(items.streak["qa"][key]),
    )


def test_a_group_counts_passes_and_fails_by_the_threshold() -> None:
    store = open_store(threshold=0.5)
    stored = store.insert_grades([grade(0, 3, i, r) for i, r in enumerate([1.0, 0.5, 0.2, 0.0])])
    assert state_of(store, 3) == (2.0, 2.0, 1, 0)
    [(source, key, state)] = stored.items
    assert (source, key, state.passes, state.fails, state.groups) == ("qa", 3, 2.0, 2.0, 1)
    [change] = stored.groups
    assert change.before.n == 0 and change.after.n == 4
    assert change.after.variance == pytest.approx(np.var([1.0, 0.5, 0.2, 0.0]))


def test_each_new_group_decays_the_earlier_evidence() -> None:
    store = open_store(decay=0.5)
    store.insert_grades([grade(0, 1, i, 1.0) for i in range(4)])
    store.insert_grades([grade(1, 1, i, 0.0) for i in range(2)])
    # 4 passes halved, then 2 fails: (2, 2), in two groups, each scored alike within.
    assert state_of(store, 1) == (2.0, 2.0, 2, 2)


def test_a_group_graded_in_two_requests_decays_once() -> None:
    store = open_store(decay=0.5)
    store.insert_grades([grade(0, 1, 0, 1.0)])
    store.insert_grades([grade(0, 1, 1, 1.0)])
    assert state_of(store, 1) == (2.0, 0.0, 1, 1)


def test_the_zero_variance_streak_grows_and_breaks() -> None:
    store = open_store()
    for iteration in range(3):
        store.insert_grades([grade(iteration, 2, i, 0.0) for i in range(4)])
    assert state_of(store, 2)[3] == 3
    store.insert_grades([grade(3, 2, 0, 0.0), grade(3, 2, 1, 1.0)])
    assert state_of(store, 2)[3] == 0


def test_a_later_differing_grade_of_the_newest_group_undoes_its_streak_step() -> None:
    store = open_store()
    store.insert_grades([grade(0, 2, i, 1.0) for i in range(2)])
    store.insert_grades([grade(1, 2, 0, 1.0), grade(1, 2, 1, 1.0)])
    assert state_of(store, 2)[3] == 2
    store.insert_grades([grade(1, 2, 2, 0.0)])  # the newest group now has variance
    assert state_of(store, 2)[3] == 0


def test_one_completion_says_nothing_about_variance() -> None:
    store = open_store()
    store.insert_grades([grade(0, 2, i, 1.0) for i in range(2)])
    store.insert_grades([grade(1, 2, 0, 1.0)])
    assert state_of(store, 2)[3] == 1


def test_a_late_grade_of_an_older_group_moves_the_posterior_not_the_streak() -> None:
    store = open_store(decay=1.0)
    store.insert_grades([grade(5, 2, i, 0.0) for i in range(2)])
    store.insert_grades([grade(4, 2, i, 1.0) for i in range(2)])
    assert state_of(store, 2) == (2.0, 2.0, 2, 1)


def test_errors_and_repeated_grades_are_not_folded() -> None:
    store = open_store()
    store.insert_grades([grade(0, 4, 0, 1.0), grade(0, 4, 1, 0.0, error="boom")])
    again = store.insert_grades([grade(0, 4, 0, 1.0)])
    assert again.outcomes == ["exists"] and again.items == [] and again.groups == []
    assert state_of(store, 4) == (1.0, 0.0, 1, 0)
    # The failed one, graded again successfully, counts then.
    store.insert_grades([grade(0, 4, 1, 1.0)])
    assert state_of(store, 4) == (2.0, 0.0, 1, 1)


def test_endless_sources_keep_groups_but_no_records() -> None:
    store = open_store()
    sid = "gen:0123456789:123456789012"
    stored = store.insert_grades([GradeRow((0, sid, 0, i, f"s{i}"), 0, "gen", 1.0, {}, None) for i in range(3)])
    assert stored.items == []
    assert [c.after.n for c in stored.groups] == [3]
    assert store.item_rows("gen") == []


def test_the_state_survives_a_restart(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s.db")
    store.insert_grades([grade(0, 7, i, float(i % 2)) for i in range(4)])
    before = state_of(store, 7)
    store.close()
    assert state_of(open_store(tmp_path / "s.db"), 7) == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=6), min_size=1, max_size=6))
def test_folding_matches_the_definition(groups: list[list[float]]) -> None:
    """However the grades arrive, the record's state is the decayed count over its groups, and the streak the
    run of zero-variance groups at its end."""
    decay = 0.7
    store = open_store(decay=decay)
    for iteration, rewards in enumerate(groups):
        store.insert_grades([grade(iteration, 0, i, r) for i, r in enumerate(rewards)])
    passes = fails = 0.0
    streak = 0
    for rewards in groups:
        passes, fails = passes * decay + sum(r >= 1.0 for r in rewards), fails * decay + sum(r < 1.0 for r in rewards)
        if len(rewards) >= 2:
            streak = streak + 1 if len(set(rewards)) == 1 else 0
    got = state_of(store, 0)
    assert got[0] == pytest.approx(passes) and got[1] == pytest.approx(fails)
    assert got[2:] == (len(groups), streak)


def test_group_variance_is_welford_exact_for_equal_rewards() -> None:
    group = GroupState(0, 0.0, 0.0)
    for _ in range(8):
        group = group.add(0.3)
    assert group.zero_variance and group.variance == 0.0
    assert not group.add(0.31).zero_variance


def test_histogram_counts_graded_records_by_posterior_mean() -> None:
    items = ItemStatistics({"qa": 4})
    items.restore("qa", [(0, 8.0, 0.0, 1, 1, -1), (1, 0.0, 8.0, 1, 1, -1), (2, 4.0, 4.0, 1, 0, -1)])
    graded, bins, mean = items.histogram("qa")
    assert graded == 3
    assert bins == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]  # 0.1, 0.5 and 0.9
    assert mean is not None and math.isclose(mean, (0.9 + 0.1 + 0.5) / 3)
    assert items.histogram("qa") == (3, bins, mean)
