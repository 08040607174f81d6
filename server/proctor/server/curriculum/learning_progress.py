"""Learning-progress mixing: a stage's source weights, set for each new iteration by how much each source is
teaching now (a non-stationary bandit over the stage's sources; docs/curricula.md has the rule and why).

Pure: the grades' groups come in through :meth:`LearningProgressMix.observe`, the weights and quotas go out.
The sampling service records each iteration's weights with it, so a replay serves the recorded batch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proctor.server.curriculum.mixing import largest_remainder
from proctor.server.spec import LearningProgressParams
from proctor.server.state.items import GroupState

__all__ = ["GroupSignal", "LearningProgressMix", "group_signal"]

# A group is (iteration, sample_id, slot): the key the state file keeps its statistics under.
GroupKey = tuple[int, str, int]


def group_signal(group: GroupState) -> float | None:
    """What a graded group teaches: GRPO's mean |advantage| over its completions when its rewards are 0 or 1,
    which is 2σ (σ its rewards' population standard deviation), capped at 1 for other rewards. 0 for a group
    that scored alike; None before its second graded completion."""
    if group.n < 2:
        return None
    if group.zero_variance:
        return 0.0
    return min(1.0, 2.0 * math.sqrt(group.m2 / group.n))


@dataclass(frozen=True, slots=True)
class GroupSignal:
    """A group's state after new grades, and the source of its record."""

    key: GroupKey
    source: str
    state: GroupState


class _Window:
    """A source's latest ``size`` groups by key (iteration first): each one's |advantage| and mean reward. A
    group's later grades replace its numbers. Kept by key, not by arrival, so that a restart that reads the latest
    groups back from the state file holds the same ones."""

    __slots__ = ("groups", "keys", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.groups: dict[GroupKey, tuple[float, float]] = {}
        self.keys: list[GroupKey] = []  # a heap: the oldest group on top

    def put(self, key: GroupKey, advantage: float, reward: float) -> None:
        if key not in self.groups:
            if len(self.groups) >= self.size and key < self.keys[0]:
                return  # older than every group kept
            heapq.heappush(self.keys, key)
            if len(self.keys) > self.size:
                del self.groups[heapq.heappop(self.keys)]
        self.groups[key] = (advantage, reward)

    @property
    def signal(self) -> float | None:
        """Mean |advantage| × (1 − mean reward), the reward clipped to [0, 1]; None without a group."""
        if not self.groups:
            return None
        # Summed afresh (exactly rounded), not kept as running totals: those drift by float noise, and the weights
        # must not depend on the order the groups arrived in.
        n = len(self.groups)
        advantage = math.fsum(a for a, _ in self.groups.values()) / n
        reward = math.fsum(r for _, r in self.groups.values()) / n
        return advantage * (1.0 - min(1.0, max(0.0, reward)))


class LearningProgressMix:
    """One ``learning_progress`` stage: each source's recent signal, the weights it gives, the quotas they give.

    ``prior`` is the stage's mix as written (replay included), weights summing to 1: with no signal yet, or
    equal signals, the stage serves it, above the floor.
    """

    def __init__(self, stage: int, prior: Sequence[tuple[str, float]], params: LearningProgressParams) -> None:
        self.stage = stage
        self.prior = tuple(prior)
        self.sources = tuple(source for source, _ in self.prior)
        self.params = params
        self._windows = {source: _Window(params.window) for source in self.sources}

    @property
    def restore_groups(self) -> int:
        """How many of the latest groups a restart reads back to refill every source's window: a source keeps at
        least ``floor`` of the batches, so its window's worth is among the latest ``window / floor`` groups."""
        share = max(self.params.floor, 1.0 / (4 * len(self.sources)))
        return math.ceil(self.params.window / share)

    def observe(self, groups: Iterable[GroupSignal]) -> None:
        """Groups that got grades, oldest first."""
        for g in groups:
            window = self._windows.get(g.source)
            advantage = group_signal(g.state)
            if window is not None and advantage is not None:
                window.put(g.key, advantage, g.state.mean)

    def signals(self) -> dict[str, float | None]:
        """Each source's learning signal over its window (None for a source with no graded group yet): the mean
        |advantage| of its groups, times what its mean reward leaves to learn (1 − reward)."""
        return {source: self._windows[source].signal for source in self.sources}

    def weights(self) -> dict[str, float]:
        """``floor + (1 − n · floor) · softmax(log prior + signal / (τ · best signal))``. Signals count relative
        to the best source's, so τ means the same whatever the rewards' scale; a source with no signal yet counts
        as the best, so that it is tried."""
        p = self.params
        signals = self.signals()
        known = [x for x in signals.values() if x is not None]
        best = max(known, default=0.0)
        logits = []
        for source, w in self.prior:
            signal = signals[source]
            relative = 1.0 if signal is None or best <= 0.0 else signal / best
            logits.append(math.log(w) + relative / p.temperature)
        top = max(logits)
        exp = [math.exp(x - top) for x in logits]
        total = math.fsum(exp)
        free = 1.0 - len(self.sources) * p.floor
        return {s: p.floor + free * e / total for s, e in zip(self.sources, exp, strict=True)}

    def quotas(
        self, weights: Mapping[str, float], batch_size: int, credits: dict[str, float], rotation: int
    ) -> list[tuple[str, int]]:
        """Each source's count in a batch of ``batch_size``. ``credits`` (updated in place) is what each source
        was owed over what it got, summed over the earlier iterations: a batch apportions its size by what each
        source is owed now (largest remainder), so every source's count stays within a prompt or two of its
        weights' sum, and a floor smaller than one prompt a batch is still served."""
        owed = [max(0.0, credits.get(s, 0.0) + weights[s] * batch_size) for s in self.sources]
        total = math.fsum(owed)
        shares = [o / total for o in owed] if total > 0 else [1.0 / len(owed)] * len(owed)
        counts = largest_remainder(shares, batch_size, rotation % len(self.sources))
        for s, count in zip(self.sources, counts, strict=True):
            credits[s] = credits.get(s, 0.0) + weights[s] * batch_size - count
        return list(zip(self.sources, counts, strict=True))
