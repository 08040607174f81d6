"""The least common multiple of micro-batch sizes, and the contiguous chunks a batch is cut into.

``lcm(rollout, ref, old)`` is the *service batch*: a batch of that many samples cuts evenly into the micro-batches
of every stage, so no stage runs a ragged last chunk. ``chunk_slices`` is how a stage walks a batch in its own
micro-batches (the last chunk is shorter when the size does not divide the batch).
"""

from __future__ import annotations

import math

__all__ = ["chunk_slices", "lcm"]


def _check_positive(value: object, what: str) -> int:
    # bool is an int subclass; True as a batch size is always a bug upstream, never a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value}")
    return value


def lcm(*sizes: int) -> int:
    """The least common multiple of one or more positive micro-batch sizes.

    >>> lcm(4, 6, 8)
    24

    Raises ``ValueError`` with no sizes or a size below 1, ``TypeError`` for a non-int (``bool`` included);
    the message names the offending value and its position.
    """
    if not sizes:
        raise ValueError("lcm needs at least one micro-batch size")
    for position, size in enumerate(sizes):
        _check_positive(size, f"micro-batch size #{position}")
    return math.lcm(*sizes)


def chunk_slices(n: int, size: int) -> list[slice]:
    """Contiguous slices covering ``range(n)`` in chunks of ``size``; the last one is shorter when needed.

    >>> chunk_slices(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]

    ``n == 0`` gives ``[]``. Raises ``ValueError`` for a negative ``n`` or a ``size`` below 1.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {n!r} ({type(n).__name__})")
    if n < 0:
        raise ValueError(f"n must be zero or more, got {n}")
    _check_positive(size, "chunk size")
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]
