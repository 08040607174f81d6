"""The refill rule: which groups it keeps, and the records that replace the others."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.server.curriculum.refill import GroupGrades, keeps, replacement_key
from proctor.server.spec import MeanRewardOutsideRefillSpec, ZeroVarianceRefillSpec

ZERO_VARIANCE = ZeroVarianceRefillSpec(kind="zero_variance")
MIDDLE = MeanRewardOutsideRefillSpec(kind="mean_reward_outside", low=0.25, high=0.75)


@pytest.mark.parametrize(
    ("rewards", "kept"),
    [
        ([0.0, 1.0], True),
        ([1.0, 1.0, 1.0], False),
        ([0.0, 0.0], False),
        ([0.5], False),
        ([], False),
        ([0.2, 0.3], True),
    ],
)
def test_zero_variance_keeps_a_group_whose_rewards_differ(rewards: list[float], kept: bool) -> None:
    assert keeps(ZERO_VARIANCE, GroupGrades.of(rewards)) is kept


@pytest.mark.parametrize(
    ("rewards", "kept"),
    [([0.0, 1.0], True), ([0.0, 0.0, 1.0, 1.0], True), ([1.0, 1.0, 1.0, 0.0], True), ([0.0, 0.0, 0.0, 1.0], True),
     ([1.0, 1.0], False), ([0.0, 0.1], False), ([], False)],
)  # fmt: skip
def test_mean_reward_outside_keeps_a_group_whose_mean_is_in_range(rewards: list[float], kept: bool) -> None:
    assert keeps(MIDDLE, GroupGrades.of(rewards)) is kept


@given(
    size=st.integers(1, 200),
    held=st.sets(st.integers(0, 199), max_size=200),
    iteration=st.integers(0, 10**6),
    round_=st.integers(1, 16),
    position=st.integers(0, 4096),
)
def test_a_replacement_is_a_record_of_the_source_the_step_does_not_hold(
    size: int, held: set[int], iteration: int, round_: int, position: int
) -> None:
    held = {k for k in held if k < size}
    key = replacement_key(7, "src", size, iteration, round_, position, held)
    assert 0 <= key < size
    if len(held) < size:
        assert key not in held
    # Seeded by its arguments alone: every rank, retry and restart draws the same record.
    assert replacement_key(7, "src", size, iteration, round_, position, set(held)) == key


def test_an_endless_source_draws_keys_far_past_its_stream() -> None:
    keys = {replacement_key(7, "gen", None, 3, 1, p, set()) for p in range(100)}
    assert len(keys) == 100
    assert all(0 <= k < 2**52 for k in keys)
    assert min(keys) > 10**9  # the stream's own positions are counted from 0
