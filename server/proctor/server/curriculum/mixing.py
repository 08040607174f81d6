"""Which records make up a batch: exact per-source quotas and seeded, epoch-wise streams per source.

Every source is read as an endless stream: epoch ``e`` of a source with ``n`` rows is a seeded permutation
of its rows; a procedural source's stream is simply ``0, 1, 2, …``. A batch takes, from each source, the
next ``quota`` entries of its stream, where the quotas split the batch by the stage's weights with the
largest-remainder method (exact, not coin flips).

**Positions in closed form.** The position of a source's stream at iteration ``i`` is the sum of its quotas
over iterations ``0..i-1``, computed as if each of them had the same ``batch_size`` as iteration ``i``, using
the stage each of them had or will have. Within one stage the quotas repeat with a period of the stage's
source count (only the tie-break rotates), and stages only advance, so that sum is a handful of
multiplications per stage: serving iteration 10^15 costs what serving iteration 1 costs.

**No repeat inside a batch while a source has rows enough.** A batch that straddles an epoch boundary takes
the end of epoch ``e`` and the start of epoch ``e + 1``. Where the new epoch's start holds a row that the same
batch already took from the old epoch's end, that row is skipped and the next row of the new epoch that the
batch does not hold takes its place (found by walking the new epoch's order past the batch's share of it: at
most ``quota`` steps). So a source with at least ``quota`` rows never repeats a row inside a batch. The cost:
a skipped row waits for the epoch after, and its substitute is served twice in the new epoch, once here and
once at its own place. The rule looks only at the straddling batch itself, so it stays a pure function of
the iteration. Only a source with fewer rows than its quota must repeat rows inside a batch.

A batch is therefore a pure function of (curriculum, seed, iteration, batch_size, stage history).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.permutation import Permutation, derive_key

__all__ = ["Mixer", "largest_remainder", "stage_runs", "stage_weights"]

# Quota tables for (stage, batch_size) pairs; clients choose batch sizes, so the table count is bounded.
_QUOTA_TABLES = 256
_PERMUTATIONS = 16  # epoch permutations kept (a straddling batch reads two epochs of one source)


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


def stage_runs(stage_of: Callable[[int], int], end: int, start: int = 0) -> list[tuple[int, int, int]]:
    """``(first, stop, stage)`` for the maximal runs of one stage over iterations ``start..end-1``.

    ``stage_of`` must never decrease (stages only advance), so each run's end is found by bisection:
    ``O(stages × log end)`` calls, whatever ``end`` is.
    """
    runs: list[tuple[int, int, int]] = []
    first = start
    while first < end:
        stage = stage_of(first)
        # Bisect for the first iteration in [first, end) that is past this stage (by hand: `bisect` over a
        # range stops at 2**63 items).
        lo, hi = first + 1, end
        while lo < hi:
            mid = (lo + hi) // 2
            if stage_of(mid) > stage:
                hi = mid
            else:
                lo = mid + 1
        runs.append((first, lo, stage))
        first = lo
    return runs


class _QuotaTable:
    """A stage's quotas at one batch size: periodic in the iteration, with prefix sums over one period."""

    __slots__ = ("per_period", "period", "prefix", "sources")

    def __init__(self, weights: tuple[tuple[str, float], ...], batch_size: int) -> None:
        self.sources = [source for source, _ in weights]
        self.period = len(weights)  # the tie-break rotation repeats every `len(weights)` iterations
        rows = [largest_remainder([w for _, w in weights], batch_size, rotation=r) for r in range(self.period)]
        self.prefix: list[list[int]] = [[0] * self.period]
        for row in rows:
            self.prefix.append([acc + q for acc, q in zip(self.prefix[-1], row, strict=True)])
        self.per_period = self.prefix[-1]

    def taken_before(self, iteration: int) -> list[int]:
        """Per source, the quotas of iterations ``0..iteration-1`` summed as if all were in this stage."""
        cycles, rest = divmod(iteration, self.period)
        return [cycles * full + part for full, part in zip(self.per_period, self.prefix[rest], strict=True)]


class Mixer:
    """Turns (iteration, batch_size, stage history) into the ordered list of records of a batch."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum = curriculum
        self._weights = [stage_weights(curriculum, s.index) for s in curriculum.stages]
        self._sizes = {name: src.size for name, src in curriculum.sources.items()}
        self._tables: OrderedDict[tuple[int, int], _QuotaTable] = OrderedDict()
        self._permutations: OrderedDict[tuple[str, int], Permutation] = OrderedDict()

    def quotas(self, stage: int, batch_size: int, iteration: int) -> list[tuple[str, int]]:
        # Read from the same table the stream positions come from, so that draws and positions cannot drift.
        table = self._table(stage, batch_size)
        r = iteration % table.period
        return [(s, hi - lo) for s, lo, hi in zip(table.sources, table.prefix[r], table.prefix[r + 1], strict=True)]

    def cursors(self, iteration: int, batch_size: int, stage_of: Callable[[int], int]) -> dict[str, int]:
        """Each source's stream position at the start of ``iteration``: what iterations ``0..iteration-1``
        took from it, each at ``batch_size``. Independent of how large ``iteration`` is."""
        cursors: dict[str, int] = {}
        for first, stop, stage in stage_runs(stage_of, iteration):
            table = self._table(stage, batch_size)
            for source, before, upto in zip(
                table.sources, table.taken_before(first), table.taken_before(stop), strict=True
            ):
                cursors[source] = cursors.get(source, 0) + upto - before
        return cursors

    def draw(self, iteration: int, batch_size: int, stage_of: Callable[[int], int]) -> list[tuple[str, int]]:
        """``(source, record key)`` pairs of the batch, in serving order.

        ``stage_of(j)`` must give the stage of every iteration ``j <= iteration`` (for iterations that were
        already sampled, the recorded one) and never decrease.
        """
        cursors = self.cursors(iteration, batch_size, stage_of)
        picks: list[tuple[str, int]] = []
        for source, count in self.quotas(stage_of(iteration), batch_size, iteration):
            picks.extend((source, key) for key in self.take(source, cursors.get(source, 0), count))
        return self.order(picks, iteration, batch_size)

    def order(self, picks: list[tuple[str, int]], iteration: int, batch_size: int) -> list[tuple[str, int]]:
        """The serving order of a batch's picks (shuffled in place, and returned)."""
        # Mixed order, so that every rank's contiguous share sees the whole mix rather than one source.
        random.Random(derive_key(self.curriculum.seed, "order", iteration, batch_size)).shuffle(picks)
        return picks

    def take(self, source: str, start: int, count: int) -> list[int]:
        """The record keys at stream positions ``start .. start+count-1``, without a repeat when the source
        has at least ``count`` rows (see the module docstring)."""
        size = self._sizes[source]
        if size is None:
            return list(range(start, start + count))
        keys = [self._permutation(source, p // size)[p % size] for p in range(start, start + count)]
        boundary = (start // size + 1) * size
        if count > size or start + count <= boundary:
            return keys
        old = set(keys[: boundary - start])
        new_epoch = self._permutation(source, boundary // size)
        # Substitutes come from the new epoch past this batch's share of it: rows that cannot be in the batch
        # yet. There are enough, because the old epoch's end holds `boundary - start` rows and count <= size.
        after = start + count - boundary
        for i in range(boundary - start, count):
            if keys[i] in old:
                while new_epoch[after] in old:
                    after += 1
                keys[i] = new_epoch[after]
                after += 1
        return keys

    def _table(self, stage: int, batch_size: int) -> _QuotaTable:
        key = (stage, batch_size)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _QuotaTable(self._weights[stage], batch_size)
            if len(self._tables) > _QUOTA_TABLES:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return table

    def _permutation(self, source: str, epoch: int) -> Permutation:
        key = (source, epoch)
        perm = self._permutations.get(key)
        if perm is None:
            size = self._sizes[source]
            assert size is not None
            perm = Permutation(size, derive_key(self.curriculum.seed, source, "epoch", epoch))
            self._permutations[key] = perm
            if len(self._permutations) > _PERMUTATIONS:
                self._permutations.popitem(last=False)
        return perm
