"""Where a curriculum stands while it is served: its stage schedule, the statistics its gates read, and the
last iteration sampled. Pure: the store restores it, and the sampling and grading services move it on."""

from __future__ import annotations

from collections.abc import Sequence

from proctor.server.curriculum.engine import StageSchedule, TransitionRecord
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.statistics import CurriculumStatistics

__all__ = ["CurriculumProgress"]


class CurriculumProgress:
    def __init__(
        self,
        curriculum: Curriculum,
        schedule: StageSchedule,
        statistics: CurriculumStatistics,
        last_iteration: int | None,
    ) -> None:
        self.curriculum = curriculum
        self.schedule = schedule
        self.statistics = statistics
        self.last_iteration = last_iteration

    def stage_of(self, iteration: int) -> int:
        return self.schedule.stage_of(iteration)

    def begin(self, iteration: int, batch_size: int) -> tuple[int, list[TransitionRecord]]:
        """Decide the stage of a new iteration (and the transitions that lead to it) and count it as served.

        Gates are evaluated only at the frontier: an iteration below the last one sampled (a gap filled in
        late) takes the stage the recorded transitions give it.
        """
        transitions: Sequence[TransitionRecord] = []
        if self.last_iteration is None or iteration > self.last_iteration:
            transitions = self.schedule.decide(iteration, self.statistics.gate_view)
        self.schedule.apply(transitions)
        stage = self.schedule.stage_of(iteration)
        self.statistics.served(stage, batch_size)
        self.last_iteration = iteration if self.last_iteration is None else max(self.last_iteration, iteration)
        return stage, list(transitions)
