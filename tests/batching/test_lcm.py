"""``lcm`` of micro-batch sizes and ``chunk_slices``: worked values, errors that name the bad value, properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.batching.lcm import chunk_slices, lcm


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        pytest.param((4,), 4, id="one-size"),
        pytest.param((1, 1, 1), 1, id="all-ones"),
        pytest.param((2, 3), 6, id="coprime"),
        pytest.param((4, 6, 8), 24, id="rollout-ref-old"),
        pytest.param((8, 8, 8), 8, id="equal"),
        pytest.param((12, 18), 36, id="shared-factor"),
        pytest.param((16, 4, 2), 16, id="one-divides-the-rest"),
        pytest.param((3, 5, 7, 2), 210, id="four-sizes"),
    ],
)
def test_lcm_values(sizes: tuple[int, ...], expected: int) -> None:
    assert lcm(*sizes) == expected


@pytest.mark.parametrize(
    ("sizes", "error", "message"),
    [
        pytest.param((), ValueError, "lcm needs at least one micro-batch size", id="none"),
        pytest.param((4, 0), ValueError, "micro-batch size #1 must be a positive integer, got 0", id="zero"),
        pytest.param((-2, 4), ValueError, "micro-batch size #0 must be a positive integer, got -2", id="negative"),
        pytest.param((4, 2.0), TypeError, "micro-batch size #1 must be an int, got 2.0 (float)", id="float"),
        pytest.param((True, 2), TypeError, "micro-batch size #0 must be an int, got True (bool)", id="bool"),
    ],
)
def test_lcm_errors(sizes: tuple[object, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        lcm(*sizes)  # type: ignore[arg-type]
    assert str(caught.value) == message


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=3))
def test_lcm_is_the_least_common_multiple(sizes: list[int]) -> None:
    result = lcm(*sizes)

    assert all(result % size == 0 for size in sizes)
    # Brute force, independent of math.lcm: no smaller positive number is a multiple of every size.
    assert not any(all(candidate % size == 0 for size in sizes) for candidate in range(1, result))


@pytest.mark.parametrize(
    ("n", "size", "expected"),
    [
        pytest.param(0, 4, [], id="empty"),
        pytest.param(5, 2, [slice(0, 2), slice(2, 4), slice(4, 5)], id="short-last"),
        pytest.param(6, 3, [slice(0, 3), slice(3, 6)], id="even"),
        pytest.param(3, 8, [slice(0, 3)], id="size-larger-than-n"),
        pytest.param(3, 1, [slice(0, 1), slice(1, 2), slice(2, 3)], id="size-one"),
    ],
)
def test_chunk_slices_values(n: int, size: int, expected: list[slice]) -> None:
    assert chunk_slices(n, size) == expected


@pytest.mark.parametrize(
    ("n", "size", "error", "message"),
    [
        pytest.param(4, 0, ValueError, "chunk size must be a positive integer, got 0", id="zero-size"),
        pytest.param(4, -1, ValueError, "chunk size must be a positive integer, got -1", id="negative-size"),
        pytest.param(-1, 2, ValueError, "n must be zero or more, got -1", id="negative-n"),
        pytest.param(4.0, 2, TypeError, "n must be an int, got 4.0 (float)", id="float-n"),
    ],
)
def test_chunk_slices_errors(n: object, size: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        chunk_slices(n, size)  # type: ignore[arg-type]
    assert str(caught.value) == message


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 50), st.integers(1, 12))
def test_chunk_slices_cover_range_contiguously(n: int, size: int) -> None:
    slices = chunk_slices(n, size)

    assert [index for piece in slices for index in range(n)[piece]] == list(range(n))
    assert len(slices) == math.ceil(n / size)
    assert all(piece.stop - piece.start == size for piece in slices[:-1])
    if slices:
        assert 0 < slices[-1].stop - slices[-1].start <= size
