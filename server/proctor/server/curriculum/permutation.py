"""Seeded permutations of ``range(n)`` that cost O(1) memory and O(1) time per element.

Each epoch of a finite source is a different pseudo-random permutation of its rows. Materialising and
shuffling a list would stall a request for seconds at every epoch boundary of a large dataset; a small
Feistel network over the next power of two, with cycle walking back into ``[0, n)``, gives the same
"every row exactly once per epoch" guarantee without ever touching the whole range.
"""

from __future__ import annotations

import hashlib

__all__ = ["Permutation", "derive_key"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts; stable across processes and Python versions."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _mix(x: int) -> int:
    # splitmix64's finaliser: cheap, and every input bit affects every output bit.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class Permutation:
    """A bijection of ``range(n)`` chosen by ``key``: ``perm[i]`` for ``0 <= i < n``."""

    __slots__ = ("_half", "_keys", "_mask", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n ≥ 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2  # a balanced Feistel network needs an even bit width
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys = tuple(_mix(key + r + 1) for r in range(_ROUNDS))

    def _encrypt(self, x: int) -> int:
        half, mask = self._half, self._mask
        left, right = x >> half, x & mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        # The domain is at most 4n, so the walk takes fewer than 4 steps on average.
        y = self._encrypt(i)
        while y >= self.n:
            y = self._encrypt(y)
        return y

    def __len__(self) -> int:
        return self.n
