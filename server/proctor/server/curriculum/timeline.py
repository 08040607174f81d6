"""The run as the live page draws it: per iteration, its stage, its grades and its groups (the latest
iterations only), and the latest grader errors. Pure: the state file restores it, the sampling service and
the grade ledger move it on."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proctor.server.state.rows import GradeRow, GroupChange, IterationTotals

__all__ = ["RECENT_ERRORS", "TIMELINE_ITERATIONS", "IterationTally", "Timeline"]

TIMELINE_ITERATIONS = 2048
RECENT_ERRORS = 20


@dataclass(slots=True)
class IterationTally:
    iteration: int
    stage: int
    graded: int = 0
    errors: int = 0
    reward_sum: float = 0.0
    groups: int = 0
    zero_variance_groups: int = 0
    mix_weights: dict[str, float] | None = None  # a learning-progress stage's source weights
    refill_rounds: int = 0  # refill rounds that replaced groups
    refilled_groups: int = 0

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.graded if self.graded else None


class Timeline:
    def __init__(self) -> None:
        # In the order iterations were first sampled (almost always increasing); the oldest go first.
        self._tallies: OrderedDict[int, IterationTally] = OrderedDict()
        self.errors: deque[tuple[int, str, str]] = deque(maxlen=RECENT_ERRORS)  # newest first

    def restore(
        self,
        totals: Iterable[IterationTotals],
        errors: Sequence[tuple[int, str, str]],
        mix_weights: Mapping[int, dict[str, float]] | None = None,
        refills: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        weights, refilled = mix_weights or {}, refills or {}
        for t in totals:
            self._add(
                IterationTally(
                    t.iteration,
                    t.stage,
                    t.graded,
                    t.errors,
                    t.reward_sum,
                    t.groups,
                    t.zero_variance_groups,
                    weights.get(t.iteration),
                    *refilled.get(t.iteration, (0, 0)),
                )
            )
        self.errors.clear()
        self.errors.extend(errors)

    def served(self, iteration: int, stage: int) -> None:
        self._add(IterationTally(iteration, stage))

    def mixed(self, iteration: int, weights: dict[str, float]) -> None:
        """The source weights a learning-progress stage served ``iteration`` with."""
        tally = self._tallies.get(iteration)
        if tally is not None:
            tally.mix_weights = dict(weights)

    def refilled(self, iteration: int, groups: int) -> None:
        """A refill round of ``iteration`` replaced ``groups`` groups."""
        tally = self._tallies.get(iteration)
        if tally is not None and groups:
            tally.refill_rounds += 1
            tally.refilled_groups += groups

    def _add(self, tally: IterationTally) -> None:
        self._tallies[tally.iteration] = tally
        while len(self._tallies) > TIMELINE_ITERATIONS:
            self._tallies.popitem(last=False)

    def graded(self, rows: Iterable[tuple[GradeRow, bool]], groups: Iterable[GroupChange]) -> None:
        """Newly counted grades (with whether each replaced a counted error) and the groups they changed."""
        for row, replaced_error in rows:
            tally = self._tallies.get(row.key[0])
            if row.error is not None:
                self.errors.appendleft((row.key[0], row.key[1], row.error))
            if tally is None:
                continue
            if replaced_error:
                tally.errors -= 1
            if row.error is None:
                tally.graded += 1
                tally.reward_sum += row.reward
            else:
                tally.errors += 1
        for change in groups:
            tally = self._tallies.get(change.iteration)
            if tally is None:
                continue
            tally.groups += int(change.after.counted) - int(change.before.counted)
            tally.zero_variance_groups += int(change.after.zero_variance) - int(change.before.zero_variance)

    def tallies(self) -> list[IterationTally]:
        """The kept iterations, in iteration order."""
        return sorted(self._tallies.values(), key=lambda t: t.iteration)
