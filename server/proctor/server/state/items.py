"""What the grades say about each record: a decayed Beta posterior of its pass rate, the groups it was served
in, and how many of its latest groups scored alike (zero variance, so zero advantage under GRPO).

A *group* is one prompt's completions at one iteration: ``(iteration, sample_id, slot)``. A *record* is a
source and a record key. The rules, applied one graded completion at a time so that a group's grades may
arrive in any number of requests:

- the first grade of a new group multiplies the record's earlier evidence by ``decay`` and counts the group;
- every grade adds a pass (reward ≥ the source's ``pass_threshold``) or a fail;
- the zero-variance streak is the number of the record's latest groups, its newest included, whose graded
  completions (two or more) all got the same reward. A group that later gets a differing grade breaks it.

The state file folds the grades in (:meth:`proctor.server.store.Store.insert_grades`), in the transaction that
stores them, and hands back the new state of each record it touched; :class:`ItemStatistics` holds that state
in memory, for finite sources only: one row of a few numbers per record, whatever the number of grades.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "PASS_RATE_BINS",
    "ZERO_VARIANCE",
    "GroupState",
    "ItemState",
    "ItemStatistics",
    "ItemTracking",
    "fold_grade",
]

PASS_RATE_BINS = 10
# Rewards are floats from arbitrary graders: equal rewards give an m2 of exactly 0 under Welford's update, and
# anything below this is rounding noise of rewards that were meant to be equal.
ZERO_VARIANCE = 1e-12


@dataclass(frozen=True, slots=True)
class ItemTracking:
    """Which sources keep per-record state (the finite ones), their pass thresholds and the decay."""

    pass_thresholds: Mapping[str, float]  # every source: groups are kept for all of them
    finite: frozenset[str]
    decay: float


@dataclass(frozen=True, slots=True)
class GroupState:
    """One group's graded completions: count, mean reward and Welford's sum of squared deviations."""

    n: int
    mean: float
    m2: float

    @property
    def counted(self) -> bool:
        """Whether the group has a variance at all (two graded completions or more)."""
        return self.n >= 2

    @property
    def zero_variance(self) -> bool:
        return self.n >= 2 and self.m2 <= ZERO_VARIANCE

    @property
    def variance(self) -> float | None:
        return self.m2 / self.n if self.n >= 2 else None

    def add(self, reward: float) -> GroupState:
        n = self.n + 1
        delta = reward - self.mean
        mean = self.mean + delta / n
        return GroupState(n, mean, self.m2 + delta * (reward - mean))


NEW_GROUP = GroupState(0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class ItemState:
    """One record's state. ``last_group`` is the ``(iteration, slot)`` of its newest group; ``streak_before``
    the streak before that group, so that the newest group's later grades can recompute the streak."""

    passes: float = 0.0
    fails: float = 0.0
    groups: int = 0
    streak: int = 0
    streak_before: int = 0
    last_group: tuple[int, int] = (-1, -1)
    served_epoch: int = -1


def fold_grade(
    item: ItemState, group: GroupState, updated: GroupState, where: tuple[int, int], passed: bool, decay: float
) -> ItemState:
    """``item`` after one more graded completion of the group at ``where`` (``group`` before it, ``updated``
    after it)."""
    passes, fails, groups = item.passes, item.fails, item.groups
    if group.n == 0:
        passes, fails, groups = passes * decay, fails * decay, groups + 1
    if passed:
        passes += 1.0
    else:
        fails += 1.0
    streak, before, last = item.streak, item.streak_before, item.last_group
    if where > last:  # a newer group than any before: the streak so far is what it extends
        before, last = streak, where
    if where == last:
        if updated.zero_variance:
            streak = before + 1
        elif updated.counted:
            streak = 0
        else:
            streak = before  # one completion says nothing yet
    # A grade of an older group (arriving late) moves the posterior but not the streak, which is about the newest.
    return ItemState(passes, fails, groups, streak, before, last, item.served_epoch)


class ItemStatistics:
    """Per-record state of the finite sources, as numpy columns indexed by record key."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.version = 0  # moves whenever a record's grades change: what the histograms are cached by
        self._histograms: dict[str, tuple[int, tuple[int, list[int], float | None]]] = {}
        self.passes: dict[str, npt.NDArray[np.float64]] = {}
        self.fails: dict[str, npt.NDArray[np.float64]] = {}
        self.groups: dict[str, npt.NDArray[np.int64]] = {}
        self.streak: dict[str, npt.NDArray[np.int64]] = {}
        self.served_epoch: dict[str, npt.NDArray[np.int64]] = {}
        for source, n in self.sizes.items():
            self.passes[source] = np.zeros(n, dtype=np.float64)
            self.fails[source] = np.zeros(n, dtype=np.float64)
            self.groups[source] = np.zeros(n, dtype=np.int64)
            self.streak[source] = np.zeros(n, dtype=np.int64)
            self.served_epoch[source] = np.full(n, -1, dtype=np.int64)

    def tracks(self, source: str) -> bool:
        return source in self.sizes

    def set(self, source: str, key: int, state: ItemState) -> None:
        """A record's new state after grades. Its ``served_epoch`` is left alone: the samplers set it when they
        serve the record, before the state file has it."""
        if source not in self.sizes or not 0 <= key < self.sizes[source]:
            return
        self.passes[source][key] = state.passes
        self.fails[source][key] = state.fails
        self.groups[source][key] = state.groups
        self.streak[source][key] = state.streak
        self.version += 1

    def restore(self, source: str, rows: Sequence[tuple[int, float, float, int, int, int]]) -> None:
        """Rows of ``(key, passes, fails, groups, streak, served_epoch)`` as the state file kept them."""
        if source not in self.sizes or not rows:
            return
        # Column by column: a million rows at start-up, which a loop in Python would take a second over.
        keys, passes, fails, groups, streak, served = (np.array(column) for column in zip(*rows, strict=True))
        inside = (keys >= 0) & (keys < self.sizes[source])
        keys = keys[inside]
        self.passes[source][keys] = passes[inside]
        self.fails[source][keys] = fails[inside]
        self.groups[source][keys] = groups[inside]
        self.streak[source][keys] = streak[inside]
        self.served_epoch[source][keys] = served[inside]
        self.version += 1

    def pass_rate(
        self, source: str, prior: tuple[float, float] = (1.0, 1.0), keys: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.float64]:
        """The posterior mean pass rate of each record (or of ``keys``)."""
        a, b = prior
        passes, fails = self.passes[source], self.fails[source]
        if keys is not None:
            passes, fails = passes[keys], fails[keys]
        result: npt.NDArray[np.float64] = (passes + a) / (passes + fails + a + b)
        return result

    def histogram(self, source: str) -> tuple[int, list[int], float | None]:
        """Records with a graded group, their count by posterior mean pass rate (10 bins), and the mean.

        A pass over every record of the source, so it is kept until the next grade: the live page asks for
        it every two seconds, per viewer."""
        cached = self._histograms.get(source)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        result = self._histogram(source)
        self._histograms[source] = (self.version, result)
        return result

    def _histogram(self, source: str) -> tuple[int, list[int], float | None]:
        graded = self.groups[source] > 0
        count = int(graded.sum())
        if count == 0:
            return 0, [0] * PASS_RATE_BINS, None
        rates = self.pass_rate(source)[graded]
        bins = np.minimum((rates * PASS_RATE_BINS).astype(np.int64), PASS_RATE_BINS - 1)
        return count, np.bincount(bins, minlength=PASS_RATE_BINS).tolist(), float(rates.mean())
