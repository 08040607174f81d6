"""Tests for :mod:`proctor.server.curriculum.sumtree`."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.server.curriculum.sumtree import WEIGHT_SCALE, SumTree, quantize

weights_lists = st.lists(st.integers(min_value=0, max_value=WEIGHT_SCALE), min_size=1, max_size=70)


def expected_index(weights: list[int], point: int) -> int:
    return bisect_right(list(accumulate(weights)), point)


@given(weights_lists, st.data())
def test_find_is_the_inverse_of_the_cumulative_weights(weights: list[int], data: st.DataObject) -> None:
    tree = SumTree(np.array(weights, dtype=np.int64))
    assert tree.total == sum(weights)
    if tree.total:
        point = data.draw(st.integers(0, tree.total - 1))
        index = tree.find(point)
        assert index == expected_index(weights, point)
        assert weights[index] > 0


@given(weights_lists, st.lists(st.tuples(st.integers(0, 69), st.integers(0, WEIGHT_SCALE)), max_size=20), st.data())
def test_set_keeps_every_sum_exact(weights: list[int], updates: list[tuple[int, int]], data: st.DataObject) -> None:
    tree = SumTree(np.array(weights, dtype=np.int64))
    for index, weight in updates:
        index %= len(weights)
        weights[index] = weight
        tree.set(index, weight)
        assert tree.weight(index) == weight
    # Updated in any order, the tree is the one built from the final weights.
    rebuilt = SumTree(np.array(weights, dtype=np.int64))
    assert tree.total == rebuilt.total == sum(weights)
    if tree.total:
        point = data.draw(st.integers(0, tree.total - 1))
        assert tree.find(point) == rebuilt.find(point) == expected_index(weights, point)


def test_a_point_outside_the_total_is_refused() -> None:
    tree = SumTree(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match=r"point 3 is outside \[0, 3\)"):
        tree.find(3)
    with pytest.raises(ValueError, match=r"point -1 is outside"):
        tree.find(-1)


def test_quantize_clips_and_scales_alike_for_one_weight_or_many() -> None:
    many = quantize(np.array([-0.5, 0.0, 0.25, 1.0, 3.0]))
    assert many.tolist() == [0, 0, WEIGHT_SCALE // 4, WEIGHT_SCALE, WEIGHT_SCALE]
    assert [int(quantize(np.array([w]))[0]) for w in (-0.5, 0.0, 0.25, 1.0, 3.0)] == many.tolist()
