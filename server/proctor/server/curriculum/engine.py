"""Stage decisions. Pure: the recorded transitions and the gate statistics in, a decision out.

Stages are step-keyed like kolibrify's (``until_step`` ends a stage at the latest) and may carry an
``advance`` gate that ends them early. A gate is evaluated only when an iteration is sampled for the first
time at the frontier; the decision is then recorded by the store, so any later request for that iteration,
on any rank or after a restart, sees the same stage. A schedule adopted from another run
(``proctor serve --transitions``) also carries how far that run had decided: no gate fires up to there.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

from proctor.server.curriculum.loader import Stage
from proctor.server.state.rows import TransitionRecord

__all__ = ["GateView", "StageSchedule"]

# The gate's view of a stage: (mean of the latest `window` graded rewards, how many there are).
GateView = Callable[[int], tuple[float | None, int]]


class StageSchedule:
    """The stages of a curriculum plus the transitions recorded so far (append-only, in iteration order)."""

    def __init__(
        self,
        stages: Sequence[Stage],
        transitions: Sequence[TransitionRecord] = (),
        *,
        decided_through: int | None = None,
    ) -> None:
        self.stages = tuple(stages)
        self.transitions: list[TransitionRecord] = list(transitions)
        self._at = [t.iteration for t in self.transitions]
        # Iterations up to here were decided by the run this schedule was adopted from: its gates are final.
        self.decided_through = decided_through

    @property
    def current(self) -> int:
        return self.transitions[-1].to_stage if self.transitions else 0

    @property
    def current_start(self) -> int:
        return self.transitions[-1].iteration if self.transitions else 0

    def stage_of(self, iteration: int) -> int:
        """The stage that serves ``iteration``: recorded transitions first, then the until_step caps."""
        k = bisect_right(self._at, iteration)
        stage = self.transitions[k - 1].to_stage if k else 0
        last = len(self.stages) - 1
        while stage < last and iteration >= self.stages[stage].until_step:
            stage += 1
        return stage

    def decide(self, iteration: int, gate: GateView) -> list[TransitionRecord]:
        """Transitions that take effect by ``iteration``, a new iteration beyond every recorded one.

        The until_step caps passed since the current stage began come first, then the current stage's gate.
        The caller records the result (with the batch) and then calls :meth:`apply`.
        """
        stage, start = self.current, self.current_start
        last = len(self.stages) - 1
        out: list[TransitionRecord] = []
        while stage < last and iteration >= self.stages[stage].until_step:
            until = self.stages[stage].until_step
            out.append(TransitionRecord(until, stage, stage + 1, f"reached until_step {until}"))
            stage, start = stage + 1, until
        gate_spec = self.stages[stage].advance
        adopted = self.decided_through is not None and iteration <= self.decided_through
        if gate_spec is not None and stage < last and not adopted and iteration - start >= gate_spec.min_steps:
            mean, count = gate(stage)
            if mean is not None and count >= gate_spec.window and mean >= gate_spec.threshold:
                out.append(
                    TransitionRecord(
                        iteration,
                        stage,
                        stage + 1,
                        f"gate: mean reward {mean:.3f} ≥ {gate_spec.threshold:g} over the last {count} "
                        f"graded completions, after {iteration - start} iterations",
                        rolling_reward=mean,
                        rolling_count=count,
                    )
                )
        return out

    def apply(self, records: Sequence[TransitionRecord]) -> None:
        for t in records:
            if self._at and t.iteration < self._at[-1]:
                raise ValueError(f"transition at {t.iteration} comes before the recorded one at {self._at[-1]}")
            # In this order: stage_of is also read from the store's thread, and bisects _at into transitions.
            self.transitions.append(t)
            self._at.append(t.iteration)
