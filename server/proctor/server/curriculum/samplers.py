"""Adaptive samplers: which records of a source a stage serves, chosen by what the grades say about them.

A stage's mix still fixes how many prompts each source gives (:mod:`proctor.server.curriculum.mixing`); a
sampler picks which of the source's records fill them:

- ``learnability``: records weighted by p̂(1 − p̂) under their pass-rate posterior (LILO);
- ``target_difficulty``: records weighted by their nearness to a target difficulty that moves with the stage's
  recent reward (AdaRFT);
- ``skip_zero_variance``: seeded epochs that skip records whose latest groups all scored alike (GRESO).

**Epochs.** The weighted samplers never serve a record twice within an epoch. An epoch ends once the records
not yet served in it hold less than ``epoch_mass`` of the total weight; every record is then back in play.

**Determinism.** A sampler's choice is a function of the seed, the iteration, the per-record state and the
:class:`SamplerState`; the weights are integers (:mod:`proctor.server.curriculum.sumtree`), so no sum depends
on the order of updates. The state file records the per-record state with the grades and the sampler state
with each iteration, so a restarted server goes on choosing exactly as the one before it would have.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from proctor.server.curriculum.permutation import Permutation, derive_key
from proctor.server.curriculum.sumtree import SumTree, quantize
from proctor.server.sources.base import Source
from proctor.server.spec import (
    LearnabilityParams,
    SamplerSpec,
    SkipZeroVarianceParams,
    TargetDifficultyParams,
    UniformSamplerSpec,
)
from proctor.server.state.items import ItemStatistics

__all__ = [
    "Decision",
    "LearnabilitySampler",
    "RecordSampler",
    "SamplerState",
    "SkipZeroVarianceSampler",
    "StageFeedback",
    "TargetDifficultySampler",
    "build_sampler",
]


@dataclass(frozen=True, slots=True)
class StageFeedback:
    """What a sampler may read of the stage's grades when it decides an iteration."""

    rolling_reward: float | None
    graded: int


@dataclass(slots=True)
class SamplerState:
    """Everything the samplers carry from one iteration to the next, besides the per-record state: the epoch
    of each source (weighted samplers), each source's stream position (skip_zero_variance) and each stage's
    target difficulty; for a ``learning_progress`` stage, what each source is owed by the stage's quotas and,
    where its records are chosen uniformly, each source's stream position. JSON-able; recorded with every
    iteration an adaptive stage decides."""

    epochs: dict[str, int] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)
    target_graded: dict[str, int] = field(default_factory=dict)
    mix_credits: dict[str, dict[str, float]] = field(default_factory=dict)  # by stage, then source
    streams: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "epochs": dict(self.epochs),
            "cursors": dict(self.cursors),
            "targets": dict(self.targets),
            "target_graded": dict(self.target_graded),
            "mix_credits": {stage: dict(credits) for stage, credits in self.mix_credits.items()},
            "streams": dict(self.streams),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SamplerState:
        return cls(
            epochs={str(k): int(v) for k, v in data.get("epochs", {}).items()},
            cursors={str(k): int(v) for k, v in data.get("cursors", {}).items()},
            targets={str(k): float(v) for k, v in data.get("targets", {}).items()},
            target_graded={str(k): int(v) for k, v in data.get("target_graded", {}).items()},
            mix_credits={
                str(stage): {str(k): float(v) for k, v in credits.items()}
                for stage, credits in data.get("mix_credits", {}).items()
            },
            streams={str(k): int(v) for k, v in data.get("streams", {}).items()},
        )


@dataclass(slots=True)
class Decision:
    """What an adaptive stage decided for one iteration: recorded with it."""

    sampler: str
    detail: dict[str, Any] = field(default_factory=dict)
    # The records of each source chosen so far in this iteration.
    held: dict[str, list[int]] = field(default_factory=dict)


class RecordSampler(ABC):
    """Chooses records of finite sources for one stage."""

    kind: ClassVar[str]
    marks_served: ClassVar[bool] = False  # whether it keeps epochs in the records' served_epoch

    def __init__(
        self, stage: int, sources: Mapping[str, Source], items: ItemStatistics, state: SamplerState, seed: int
    ) -> None:
        self.stage = stage
        self.sources = sources
        self.items = items
        self.state = state
        self.seed = seed

    def begin(self, iteration: int, feedback: StageFeedback, decision: Decision) -> None:  # noqa: B027
        """Called once per iteration, before its sources are chosen from."""

    def prepare(self, feedback: StageFeedback) -> None:  # noqa: B027
        """New grades came in: work that the next :meth:`begin` would do with ``feedback`` may be done now, off the
        ``/sample`` path, provided it changes nothing the choice depends on."""

    def served(self, decision: Decision) -> list[tuple[str, int, int]]:
        """``(source, key, epoch)`` of the records the decision served in an epoch, once it is complete (an
        epoch that began within the batch holds the batch's earlier records too): what the state file marks."""
        if not self.marks_served:
            return []
        marks = self.items.served_epoch
        return [(source, key, int(marks[source][key])) for source, keys in decision.held.items() for key in keys]

    @abstractmethod
    def choose(self, source: str, count: int, iteration: int, decision: Decision, part: int = 0) -> list[int]:
        """``count`` record keys of ``source``; distinct while the source has that many records. A source's
        quota may be chosen in several calls (``part`` 0, 1, …), so that no call runs long."""

    def item_changed(self, source: str, key: int) -> None:  # noqa: B027
        """A record's state changed (new grades)."""

    def _rng(self, source: str, iteration: int, part: int) -> random.Random:
        return random.Random(derive_key(self.seed, "sampler", self.kind, self.stage, source, iteration, part))


class _WeightedEpochs(RecordSampler):
    """Weighted draws without replacement inside an epoch, over a :class:`SumTree` per source."""

    marks_served = True

    def __init__(
        self,
        stage: int,
        sources: Mapping[str, Source],
        items: ItemStatistics,
        state: SamplerState,
        seed: int,
        params: LearnabilityParams | TargetDifficultyParams,
    ) -> None:
        super().__init__(stage, sources, items, state, seed)
        self.explore = params.explore
        self.epoch_mass = params.epoch_mass
        self.prior = params.prior
        self._trees: dict[str, SumTree] = {}
        self._weights: dict[str, npt.NDArray[np.int64]] = {}  # every record's quantized weight, served or not
        self._totals: dict[str, int] = {}

    @abstractmethod
    def fit(self, source: str, keys: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float64]:
        """How well each record (or each of ``keys``) fits the stage now, in [0, 1]: a new array, the caller's."""

    def weights(self, source: str, keys: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
        """The quantized draw weight of each record: ``explore + (1 − explore) · fit``."""
        # In the fit's own array: a tree's rebuild computes this for every record.
        weight = self.fit(source, keys)
        np.multiply(1.0 - self.explore, weight, out=weight)
        np.add(self.explore, weight, out=weight)
        return quantize(weight)

    def _tree(self, source: str) -> SumTree:
        tree = self._trees.get(source)
        if tree is None:
            weights = self.weights(source)
            served = self.items.served_epoch[source] == self.state.epochs.get(source, 0)
            self._weights[source] = weights
            self._totals[source] = int(weights.sum())
            tree = self._trees[source] = SumTree(weights, zero=served)
        return tree

    def invalidate(self) -> None:
        """Every weight changed (a new target): the trees are rebuilt when next used."""
        self._trees.clear()

    def item_changed(self, source: str, key: int) -> None:
        tree = self._trees.get(source)
        if tree is None:
            return
        new = int(self.weights(source, np.array([key], dtype=np.int64))[0])
        self._totals[source] += new - int(self._weights[source][key])
        self._weights[source][key] = new
        if self.items.served_epoch[source][key] != self.state.epochs.get(source, 0):
            tree.set(key, new)

    def _new_epoch(self, source: str, held: Sequence[int]) -> SumTree:
        """Start the source's next epoch; the records in ``held`` (this batch's) count as served in it."""
        epoch = self.state.epochs.get(source, 0) + 1
        self.state.epochs[source] = epoch
        marks = self.items.served_epoch[source]
        for key in held:
            marks[key] = epoch
        self._trees.pop(source, None)
        tree = self._tree(source)
        if tree.total == 0:
            # No record has any weight (explore 0, every record settled): every one not held weighs the same.
            flat = np.ones(self.items.sizes[source], dtype=np.int64)
            flat[list(held)] = 0
            tree = self._trees[source] = SumTree(flat)
        return tree

    def choose(self, source: str, count: int, iteration: int, decision: Decision, part: int = 0) -> list[int]:
        rng = self._rng(source, iteration, part)
        tree = self._tree(source)
        n = self.items.sizes[source]
        marks = self.items.served_epoch[source]
        # The batch's earlier parts count as held when an epoch starts in this one.
        chosen = decision.held.setdefault(source, [])
        first = len(chosen)
        for _ in range(count):
            if tree.total == 0 or tree.total < self.epoch_mass * self._totals[source]:
                # Past n records a batch must repeat some: the new epoch then holds none of the batch back.
                tree = self._new_epoch(source, chosen if len(chosen) < n else [])
                if tree.total == 0:
                    tree = self._new_epoch(source, [])
            key = tree.find(rng.randrange(tree.total))
            tree.set(key, 0)
            marks[key] = self.state.epochs.get(source, 0)
            chosen.append(key)
        decision.detail.setdefault("epochs", {})[source] = self.state.epochs.get(source, 0)
        return chosen[first:]


class LearnabilitySampler(_WeightedEpochs):
    """Weight ∝ p̂(1 − p̂): most for records the model passes about half the time, least for the settled ones.
    A record never graded has the prior's p̂ (0.5 for the default Beta(1, 1)): the most learnable, so new
    records are tried early."""

    kind = "learnability"

    def fit(self, source: str, keys: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float64]:
        p = self.items.pass_rate(source, self.prior, keys)
        fit: npt.NDArray[np.float64] = 4.0 * p * (1.0 - p)
        return fit


class TargetDifficultySampler(_WeightedEpochs):
    """Weight by nearness to a target difficulty T on [0, 1]: a Gaussian kernel of ``width`` around T. After
    each iteration that saw new grades, T moves by ``step · tanh(sensitivity · (R̄ − target_reward))``, R̄ being
    the stage's rolling mean reward, and is clipped to [0, 1]."""

    kind = "target_difficulty"

    def __init__(
        self,
        stage: int,
        sources: Mapping[str, Source],
        items: ItemStatistics,
        state: SamplerState,
        seed: int,
        params: TargetDifficultyParams,
        static: Mapping[str, npt.NDArray[np.float64]] | None,
    ) -> None:
        super().__init__(stage, sources, items, state, seed, params)
        self.params = params
        self.static = static  # normalised difficulties, when they do not come from the pass rate
        self._difficulties: dict[str, npt.NDArray[np.float64]] = {}  # 1 − p̂ of every record, by source
        self._centre = self._grid(self.target)

    @property
    def target(self) -> float:
        return self.state.targets.get(str(self.stage), self.params.initial_target)

    def difficulty(self, source: str, keys: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float64]:
        if self.static is not None:
            values = self.static[source]
            return values if keys is None else values[keys]
        if keys is None:
            # Every record's, kept between rebuilds (the target moves most iterations, the grades touch a few
            # records each): computing it afresh is a quarter of a rebuild.
            cached = self._difficulties.get(source)
            if cached is None:
                cached = self._difficulties[source] = 1.0 - self.items.pass_rate(source, self.prior)
            return cached
        result: npt.NDArray[np.float64] = 1.0 - self.items.pass_rate(source, self.prior, keys)
        return result

    @property
    def centre(self) -> float:
        """The kernel's centre, which every weight is computed for: the target on a grid of width/8, so that the
        weights (a pass over every record) are recomputed only when the target has moved by a step of that grid.
        :meth:`prepare` may move it ahead of the target, to where the next :meth:`begin` will put it."""
        return self._centre

    def _grid(self, target: float) -> float:
        grid = self.params.width / 8
        return round(target / grid) * grid

    def _recentre(self, centre: float) -> None:
        if centre != self._centre:
            self._centre = centre
            self.invalidate()

    def fit(self, source: str, keys: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float64]:
        # exp(-0.5 · z²), z = (difficulty − centre) / width, in one scratch array: the pass over every record that
        # a moving target repeats most iterations. (Halving is exact, so -0.5 · z² is (-0.5 · z) · z to the bit.)
        fit = np.subtract(self.difficulty(source, keys), self.centre)
        np.divide(fit, self.params.width, out=fit)
        np.square(fit, out=fit)
        np.multiply(fit, -0.5, out=fit)
        np.exp(fit, out=fit)
        return fit

    def _next_target(self, feedback: StageFeedback) -> float | None:
        """Where :meth:`begin` moves the target given ``feedback``; None when it stays (no new grades)."""
        if feedback.rolling_reward is None or feedback.graded <= self.state.target_graded.get(str(self.stage), 0):
            return None
        p = self.params
        move = p.step * math.tanh(p.sensitivity * (feedback.rolling_reward - p.target_reward))
        return min(1.0, max(0.0, self.target + move))

    def begin(self, iteration: int, feedback: StageFeedback, decision: Decision) -> None:
        target = self._next_target(feedback)
        if target is not None:
            stage = str(self.stage)
            self.state.target_graded[stage] = feedback.graded
            self.state.targets[stage] = target
        self._recentre(self._grid(self.target))
        decision.detail["target"] = self.target

    def prepare(self, feedback: StageFeedback) -> None:
        """Rebuild the trees for the centre the next :meth:`begin` will move to, should no more grades arrive
        first: after a ``/grade`` rather than in the next ``/sample``. Only the trees (a cache of the weights)
        change; a restarted server that rebuilds them in :meth:`begin` draws the same."""
        target = self._next_target(feedback)
        if target is not None:
            built = list(self._trees)
            self._recentre(self._grid(target))
            for source in built:
                self._tree(source)  # the tree it has, unless the centre moved

    def item_changed(self, source: str, key: int) -> None:
        if self.static is None:  # a static difficulty does not move with the grades
            cached = self._difficulties.get(source)
            if cached is not None:
                cached[key] = self.difficulty(source, np.array([key], dtype=np.int64))[0]
            super().item_changed(source, key)


class SkipZeroVarianceSampler(RecordSampler):
    """Each source's records in seeded epochs, like ``uniform``, except that a record whose latest
    ``min_streak`` groups or more all scored alike is skipped with probability
    ``min(max_skip, 1 − (1 − skip_probability) ** (streak − min_streak + 1))``. A skipped record waits for the
    next epoch, where it is considered again: a record the model forgot comes back."""

    kind = "skip_zero_variance"
    # A batch considers at most this many records per prompt before it takes records whatever their streak.
    _MAX_WALK = 64

    def __init__(
        self,
        stage: int,
        sources: Mapping[str, Source],
        items: ItemStatistics,
        state: SamplerState,
        seed: int,
        params: SkipZeroVarianceParams,
    ) -> None:
        super().__init__(stage, sources, items, state, seed)
        self.params = params
        self._permutations: dict[tuple[str, int], Permutation] = {}

    def skip_probability(self, streak: int) -> float:
        p = self.params
        if streak < p.min_streak:
            return 0.0
        return min(p.max_skip, 1.0 - (1.0 - p.skip_probability) ** (streak - p.min_streak + 1))

    def _at(self, source: str, position: int) -> int:
        n = self.items.sizes[source]
        epoch = position // n
        perm = self._permutations.get((source, epoch))
        if perm is None:
            self._permutations = {k: v for k, v in self._permutations.items() if k[1] >= epoch - 1}
            perm = self._permutations[source, epoch] = Permutation(n, derive_key(self.seed, source, "skip", epoch))
        return perm[position % n]

    def choose(self, source: str, count: int, iteration: int, decision: Decision, part: int = 0) -> list[int]:
        n = self.items.sizes[source]
        streaks = self.items.streak[source]
        position = self.state.cursors.get(source, 0)
        chosen: list[int] = []
        earlier = decision.held.setdefault(source, [])
        held = set(earlier)
        skipped = 0
        budget = self._MAX_WALK * count
        while len(chosen) < count:
            key = self._at(source, position)
            # The coin of a stream position: the same on every server and after a restart.
            coin = derive_key(self.seed, "skip-coin", source, position) / 2.0**64
            position += 1
            if key in held and len(held) < n:
                continue
            if budget > 0 and coin < self.skip_probability(int(streaks[key])):
                skipped += 1
                budget -= 1
                continue
            chosen.append(key)
            held.add(key)
        self.state.cursors[source] = position
        skips = decision.detail.setdefault("skipped", {})
        skips[source] = skips.get(source, 0) + skipped
        earlier.extend(chosen)
        return chosen


def build_sampler(
    spec: SamplerSpec,
    stage: int,
    sources: Mapping[str, Source],
    items: ItemStatistics,
    state: SamplerState,
    seed: int,
) -> RecordSampler | None:
    """The sampler a stage's spec names, over ``sources`` (the finite sources the stage serves); None for
    ``uniform``, which the mixer serves in closed form."""
    if isinstance(spec, UniformSamplerSpec):
        return None
    if spec.kind == "learnability":
        return LearnabilitySampler(stage, sources, items, state, seed, spec.params)
    if spec.kind == "skip_zero_variance":
        return SkipZeroVarianceSampler(stage, sources, items, state, seed, spec.params)
    params = spec.params
    static = None if params.difficulty == "pass_rate" else _static_difficulties(params, sources)
    return TargetDifficultySampler(stage, sources, items, state, seed, params, static)


def _static_difficulties(
    params: TargetDifficultyParams, sources: Mapping[str, Source]
) -> dict[str, npt.NDArray[np.float64]]:
    """Each source's record difficulties, scaled together onto [0, 1] (all equal: 0.5)."""
    raw: dict[str, npt.NDArray[np.float64]] = {}
    for name, src in sources.items():
        n = src.size
        assert n is not None
        if params.difficulty == "source":
            value = src.source_difficulty()
            if value is None:
                raise ValueError(f"source {name!r} has no difficulty: give it `difficulty: <number>`")
            raw[name] = np.full(n, value, dtype=np.float64)
        else:
            values = src.record_difficulties()
            if values is None:
                raise ValueError(f"source {name!r} has no per-record difficulty")
            raw[name] = values
    lo = min(float(v.min()) for v in raw.values())
    hi = max(float(v.max()) for v in raw.values())
    if hi == lo:
        return {name: np.full_like(v, 0.5) for name, v in raw.items()}
    return {name: (v - lo) / (hi - lo) for name, v in raw.items()}
