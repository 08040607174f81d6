"""Tests for the Feistel permutations in :mod:`proctor.server.curriculum.permutation`."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.permutation import Permutation, derive_key

KEYS_64 = st.integers(min_value=0, max_value=2**64 - 1)
FIXED_KEYS = [0, 1, 2, 3, 17, 2**32, 2**63, 2**64 - 1, derive_key("seed", "a"), derive_key("seed", "b")]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=3000), key=KEYS_64)
@example(n=3000, key=2**64 - 1)
@example(n=2049, key=0)
def test_is_a_permutation_of_range_n(n: int, key: int) -> None:
    perm = Permutation(n, key)
    assert len(perm) == n
    assert sorted(perm[i] for i in range(n)) == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 255, 256, 257, 1023, 1024, 1025])
def test_is_a_permutation_around_powers_of_two(n: int) -> None:
    for key in FIXED_KEYS:
        assert sorted(Permutation(n, key)[i] for i in range(n)) == list(range(n)), key


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=1, max_value=500), key=KEYS_64)
def test_same_key_same_order(n: int, key: int) -> None:
    assert [Permutation(n, key)[i] for i in range(n)] == [Permutation(n, key)[i] for i in range(n)]


@pytest.mark.parametrize("n", [10, 11, 64, 100, 1000])
def test_different_keys_give_different_orders(n: int) -> None:
    orders = {tuple(Permutation(n, key)[i] for i in range(n)) for key in FIXED_KEYS}
    assert len(orders) == len(FIXED_KEYS)
    assert tuple(range(n)) not in orders  # and none of them is the identity


@pytest.mark.parametrize("n", [100, 1000])
def test_orders_look_shuffled(n: int) -> None:
    # Few fixed points and few ascending neighbours, as for a random permutation (about 1 and n/2).
    for key in FIXED_KEYS:
        order = [Permutation(n, key)[i] for i in range(n)]
        assert sum(order[i] == i for i in range(n)) < 10
        ascending = sum(a < b for a, b in itertools.pairwise(order))
        assert 0.35 * n < ascending < 0.65 * n


@pytest.mark.parametrize(("n", "i"), [(1, 1), (1, -1), (10, 10), (10, -1), (10, 10**6)], ids=str)
def test_index_out_of_range(n: int, i: int) -> None:
    with pytest.raises(IndexError):
        Permutation(n, 3)[i]


@pytest.mark.parametrize("n", [0, -1, -100])
def test_needs_at_least_one_element(n: int) -> None:
    with pytest.raises(ValueError, match=f"a permutation needs n ≥ 1, got {n}"):
        Permutation(n, 3)


def test_single_element() -> None:
    assert Permutation(1, 2**64 - 1)[0] == 0


def test_derive_key_is_a_stable_64_bit_digest() -> None:
    assert derive_key(17, "add", "epoch", 3) == int.from_bytes(
        hashlib.blake2b(b"17:add:epoch:3", digest_size=8).digest(), "big"
    )
    keys = {derive_key(17, "add", "epoch", e) for e in range(100)}
    assert len(keys) == 100
    assert all(0 <= k < 2**64 for k in keys)
