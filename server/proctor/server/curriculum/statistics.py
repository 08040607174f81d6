"""What was served and graded per stage: the numbers the stage gates read and ``GET /curriculum`` shows.

Pure: the store restores them at start-up and the services fold new iterations and grades in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proctor.server.curriculum.loader import Stage

__all__ = ["DEFAULT_WINDOW", "CountedGrade", "CurriculumStatistics", "StageTally", "window_size"]

DEFAULT_WINDOW = 64  # the rolling window shown for stages without a gate


@dataclass(slots=True)
class StageTally:
    """One stage's counts, and its latest error-free rewards (as many as its gate's window)."""

    window: deque[float]
    iterations: int = 0
    samples: int = 0
    graded: int = 0
    errors: int = 0
    reward_sum: float = 0.0

    @property
    def rolling(self) -> float | None:
        """Mean of the rewards in the window; None before the first grade."""
        return sum(self.window) / len(self.window) if self.window else None

    @property
    def mean(self) -> float | None:
        return self.reward_sum / self.graded if self.graded else None


@dataclass(frozen=True, slots=True)
class CountedGrade:
    """A grade just stored: its stage, its reward (None for a grader error) and whether it replaced a stored
    error (errors are graded again when posted again, so the error is counted off)."""

    stage: int
    reward: float | None
    replaced_error: bool = False


def window_size(stage: Stage) -> int:
    """How many of a stage's latest rewards its rolling mean is over: its gate's window, or the default."""
    return stage.advance.window if stage.advance else DEFAULT_WINDOW


class CurriculumStatistics:
    """A :class:`StageTally` per stage of a curriculum."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages: tuple[StageTally, ...] = tuple(StageTally(deque(maxlen=window_size(s))) for s in stages)

    def restore(
        self,
        stage: int,
        *,
        iterations: int,
        samples: int,
        graded: int,
        errors: int,
        reward_sum: float,
        recent: Iterable[float],
    ) -> None:
        """Set a stage's counts as a previous run of this state left them; ``recent`` oldest first."""
        tally = self.stages[stage]
        tally.iterations, tally.samples = iterations, samples
        tally.graded, tally.errors, tally.reward_sum = graded, errors, reward_sum
        tally.window.clear()
        tally.window.extend(recent)

    def served(self, stage: int, samples: int) -> None:
        """Count a new iteration of ``samples`` prompts."""
        tally = self.stages[stage]
        tally.iterations += 1
        tally.samples += samples

    def graded(self, grades: Iterable[CountedGrade]) -> set[int]:
        """Fold in newly stored grades; returns the stages that got a new reward."""
        touched: set[int] = set()
        for g in grades:
            tally = self.stages[g.stage]
            if g.replaced_error:
                tally.errors -= 1
            if g.reward is None:
                tally.errors += 1
                continue
            tally.graded += 1
            tally.reward_sum += g.reward
            tally.window.append(g.reward)
            touched.add(g.stage)
        return touched

    def gate_view(self, stage: int) -> tuple[float | None, int]:
        """What a stage's gate reads (a :data:`~proctor.server.curriculum.engine.GateView`): the rolling mean
        reward and how many rewards it is over."""
        tally = self.stages[stage]
        return tally.rolling, len(tally.window)
