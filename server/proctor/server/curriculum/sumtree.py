"""A sum tree over integer weights: draw an index with probability weight/total in O(log n), change one weight
in O(log n), build from n weights in O(n) numpy.

Integer weights make every sum exact, so the tree's sums, and so every draw, depend only on the weights it
holds and never on the order in which they were set: a server that rebuilds the tree after a restart draws
exactly what the one before it would have drawn.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["WEIGHT_SCALE", "SumTree", "quantize"]

WEIGHT_SCALE = 1 << 24
"""Weights in [0, 1] become integers in [0, 2**24]: a million records sum far below 2**63."""


def quantize(weights: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Float weights in [0, 1] as the integers a :class:`SumTree` holds (the same for one weight or many)."""
    # In the clipped copy: a million weights are quantized in most rebuilds of a moving target's tree.
    scaled = np.clip(weights, 0.0, 1.0)
    np.multiply(scaled, WEIGHT_SCALE, out=scaled)
    np.rint(scaled, out=scaled)
    result: npt.NDArray[np.int64] = scaled.astype(np.int64)
    return result


class SumTree:
    __slots__ = ("_leaves", "_tree", "n")

    def __init__(self, weights: npt.NDArray[np.int64], zero: npt.NDArray[np.bool_] | None = None) -> None:
        """A tree over ``weights``, those where ``zero`` is true held as 0."""
        self.n = len(weights)
        leaves = 1
        while leaves < max(self.n, 1):
            leaves *= 2
        self._leaves = leaves
        # Node i has children 2i and 2i+1; the leaves sit at [leaves, leaves + n).
        tree = np.empty(2 * leaves, dtype=np.int64)
        tree[0] = 0
        tree[leaves : leaves + self.n] = weights
        tree[leaves + self.n :] = 0
        if zero is not None:
            np.putmask(tree[leaves : leaves + self.n], zero, 0)
        lo = leaves
        while lo > 1:
            half = lo // 2
            # Into the level itself, with no temporary array: a million leaves build in about 1.5 ms, not 2.7.
            np.add(tree[lo : 2 * lo : 2], tree[lo + 1 : 2 * lo : 2], out=tree[half:lo])
            lo = half
        self._tree = tree

    @property
    def total(self) -> int:
        return int(self._tree[1])

    def weight(self, index: int) -> int:
        return int(self._tree[self._leaves + index])

    def set(self, index: int, weight: int) -> None:
        i = self._leaves + index
        delta = weight - int(self._tree[i])
        if delta == 0:
            return
        tree = self._tree
        while i >= 1:
            tree[i] += delta
            i //= 2

    def find(self, point: int) -> int:
        """The index whose share of ``[0, total)`` holds ``point``."""
        if not 0 <= point < self.total:
            raise ValueError(f"point {point} is outside [0, {self.total})")
        tree = self._tree
        i = 1
        leaves = self._leaves
        while i < leaves:
            left = int(tree[2 * i])
            if point < left:
                i = 2 * i
            else:
                point -= left
                i = 2 * i + 1
        return i - leaves
