"""Which records make up a batch: exact per-source quotas and seeded, epoch-wise streams per source.

Every source is read as an endless stream: epoch ``e`` of a source with ``n`` rows is a seeded permutation
of its rows, so no row repeats inside an epoch; a procedural source's stream is simply ``0, 1, 2, …``.
A batch takes, from each source, the next ``quota`` entries of its stream, where the quotas split the batch
by the stage's weights with the largest-remainder method (exact, not coin flips).

The position of a source's stream at iteration ``i`` is the sum of its quotas over iterations ``0..i-1``,
computed as if each of them had the same ``batch_size`` as iteration ``i``, using the stage each of them had
or will have. That makes a batch a pure function of (curriculum, seed, iteration, batch_size, stage history):
a resumed trainer gets the batches it would have had, with or without the server's state file.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.permutation import Permutation, derive_key

__all__ = ["Mixer", "largest_remainder", "stage_weights"]

# Cursor snapshots are kept at multiples of this many iterations, so that serving an old, never-sampled
# iteration walks at most this far instead of from iteration 0.
_CHECKPOINT_EVERY = 256


def largest_remainder(weights: Sequence[float], total: int, rotation: int = 0) -> list[int]:
    """Split ``total`` into integer quotas proportional to ``weights`` (which sum to 1).

    Each quota is within 1 of its exact share and the quotas sum to ``total``. Equal remainders are broken by
    ``rotation`` so that, across iterations, no source is always the one left short.
    """
    n = len(weights)
    exact = [w * total for w in weights]
    quotas = [math.floor(x) for x in exact]
    # Rounded so that float noise (0.1 * 3 = 0.30000000000000004) does not break genuine ties.
    remainders = [round(x - q, 9) for x, q in zip(exact, quotas, strict=True)]
    left = total - sum(quotas)
    order = sorted(range(n), key=lambda i: (-remainders[i], (i - rotation) % n))
    for i in order[:left]:
        quotas[i] += 1
    return quotas


def stage_weights(curriculum: Curriculum, stage: int) -> tuple[tuple[str, float], ...]:
    """The per-source weights of a stage, its replay share spread evenly over the earlier stages' mixes."""
    st = curriculum.stages[stage]
    merged: dict[str, float] = {}
    for source, w in st.mix:
        merged[source] = merged.get(source, 0.0) + (1 - st.replay) * w
    if st.replay > 0:
        per_stage = st.replay / stage
        for earlier in curriculum.stages[:stage]:
            for source, w in earlier.mix:
                merged[source] = merged.get(source, 0.0) + per_stage * w
    return tuple(merged.items())


class Mixer:
    """Turns (iteration, batch_size, stage history) into the ordered list of records of a batch."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum = curriculum
        self._weights = [stage_weights(curriculum, s.index) for s in curriculum.stages]
        self._sizes = {name: src.size for name, src in curriculum.sources.items()}
        # batch_size -> {iteration: cursor per source at the start of that iteration}
        self._cursors: dict[int, dict[int, dict[str, int]]] = {}
        # The current epoch's permutation of each source (building one costs more than a whole draw).
        self._epochs: dict[str, tuple[int, Permutation]] = {}

    def quotas(self, stage: int, batch_size: int, iteration: int) -> list[tuple[str, int]]:
        weights = self._weights[stage]
        counts = largest_remainder([w for _, w in weights], batch_size, rotation=iteration)
        return [(source, q) for (source, _), q in zip(weights, counts, strict=True)]

    def draw(self, iteration: int, batch_size: int, stage_of: Callable[[int], int]) -> list[tuple[str, int]]:
        """``(source, record key)`` pairs of the batch, in serving order.

        ``stage_of(j)`` must give the stage of every iteration ``j <= iteration``; for iterations that were
        already sampled, the recorded one.
        """
        cursors = self._cursors_at(iteration, batch_size, stage_of)
        picks: list[tuple[str, int]] = []
        for source, count in self.quotas(stage_of(iteration), batch_size, iteration):
            start = cursors.get(source, 0)
            picks.extend((source, self._stream(source, d)) for d in range(start, start + count))
        # Mixed order, so that every rank's contiguous share sees the whole mix rather than one source.
        random.Random(derive_key(self.curriculum.seed, "order", iteration, batch_size)).shuffle(picks)
        return picks

    def _stream(self, source: str, position: int) -> int:
        size = self._sizes[source]
        if size is None:
            return position
        epoch, offset = divmod(position, size)
        cached = self._epochs.get(source)
        if cached is None or cached[0] != epoch:
            cached = (epoch, Permutation(size, derive_key(self.curriculum.seed, source, "epoch", epoch)))
            self._epochs[source] = cached
        return cached[1][offset]

    def _cursors_at(self, iteration: int, batch_size: int, stage_of: Callable[[int], int]) -> dict[str, int]:
        snaps = self._cursors.setdefault(batch_size, {0: {}})
        start = max(j for j in snaps if j <= iteration)
        cursors = dict(snaps[start])
        for j in range(start, iteration):
            for source, count in self.quotas(stage_of(j), batch_size, j):
                cursors[source] = cursors.get(source, 0) + count
            if (j + 1) % _CHECKPOINT_EVERY == 0:
                snaps[j + 1] = dict(cursors)
        # Also remember where this walk ended: the next iteration usually starts right here.
        snaps[iteration] = dict(cursors)
        self._forget_stale(snaps, iteration)
        return cursors

    @staticmethod
    def _forget_stale(snaps: dict[int, dict[str, int]], keep: int) -> None:
        # Keep the checkpoints plus the latest walk end; drop older walk ends.
        for j in [j for j in snaps if j % _CHECKPOINT_EVERY and j != keep]:
            del snaps[j]
