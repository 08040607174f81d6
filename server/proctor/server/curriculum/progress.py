"""Where a curriculum stands while it is served: its stage schedule, the statistics its gates read, the
per-record state and samplers of its adaptive stages, the timeline the live page draws, and the last
iteration sampled. Pure: the store restores it, and the sampling and grading services move it on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from proctor.server.curriculum.adaptive import AdaptiveSampling, finite_sizes
from proctor.server.curriculum.engine import StageSchedule
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.mixing import Mixer
from proctor.server.curriculum.samplers import SamplerState, StageFeedback
from proctor.server.curriculum.statistics import CountedGrade, CurriculumStatistics
from proctor.server.curriculum.timeline import Timeline
from proctor.server.state.items import ItemStatistics
from proctor.server.state.rows import DecisionRow, GradeOutcome, GradeRow, StoredGrades, TransitionRecord

__all__ = ["CurriculumProgress", "IterationDraw"]


@dataclass(slots=True)
class IterationDraw:
    """A new iteration being drawn: its stage and the transitions that led to it are decided; its records are
    chosen as :meth:`steps` is consumed (the caller may hand the event loop back between steps). Then
    ``picks`` holds the batch in serving order, and ``decision`` what an adaptive stage decided."""

    iteration: int
    stage: int
    transitions: list[TransitionRecord]
    picks: list[tuple[str, int]] = field(default_factory=list)
    decision: DecisionRow | None = None
    _steps: Iterator[None] | None = None

    def steps(self) -> Iterator[None]:
        if self._steps is not None:
            yield from self._steps


class CurriculumProgress:
    def __init__(
        self,
        curriculum: Curriculum,
        schedule: StageSchedule,
        statistics: CurriculumStatistics,
        last_iteration: int | None,
        adaptive: AdaptiveSampling,
        timeline: Timeline,
    ) -> None:
        self.curriculum = curriculum
        self.schedule = schedule
        self.statistics = statistics
        self.last_iteration = last_iteration
        self.adaptive = adaptive
        self.timeline = timeline

    @classmethod
    def start(
        cls,
        curriculum: Curriculum,
        *,
        transitions: Sequence[TransitionRecord] = (),
        decided_through: int | None = None,
        last_iteration: int | None = None,
        sampler_state: SamplerState | None = None,
    ) -> CurriculumProgress:
        """A curriculum's progress with the stage history and sampler state given, and empty statistics, per-record
        state and timeline (a restart fills them in from the state file)."""
        schedule = StageSchedule(curriculum.stages, transitions, decided_through=decided_through)
        items = ItemStatistics(finite_sizes(curriculum))
        adaptive = AdaptiveSampling(curriculum, items, sampler_state or SamplerState())
        statistics = CurriculumStatistics(curriculum.stages)
        return cls(curriculum, schedule, statistics, last_iteration, adaptive, Timeline())

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
        self.timeline.served(iteration, stage)
        self.last_iteration = iteration if self.last_iteration is None else max(self.last_iteration, iteration)
        return stage, list(transitions)

    def draw(self, iteration: int, batch_size: int, mixer: Mixer) -> IterationDraw:
        """Begin a new iteration (:meth:`begin`) and draw its batch: in closed form for a stage with a fixed mix
        and uniform records; otherwise with the quotas of its learning-progress mix and its records from the
        stage's sampler (or each source's stream, for uniform records)."""
        stage, transitions = self.begin(iteration, batch_size)
        out = IterationDraw(iteration, stage, transitions)
        sampler = self.adaptive.sampler(stage)
        mix = self.adaptive.mixes.get(stage)
        if sampler is None and mix is None:
            out.picks = mixer.draw(iteration, batch_size, self.stage_of)
            return out
        state = self.adaptive.state
        mixed: dict[str, Any] = {}
        if mix is None:
            quotas = mixer.quotas(stage, batch_size, iteration)
        else:
            weights, signals = mix.weights(), mix.signals()
            quotas = mix.quotas(weights, batch_size, state.mix_credits.setdefault(str(stage), {}), iteration)
            mixed = {"mix": {"weights": weights, "signals": signals, "quotas": dict(quotas)}}
            self.timeline.mixed(iteration, weights)
        if sampler is None:
            if any(source not in state.streams for source, _ in quotas):
                # A source's first draw here starts where the stage's fixed mix would have left its stream.
                cursors = mixer.cursors(iteration, batch_size, self.stage_of)
                for source, _ in quotas:
                    state.streams.setdefault(source, cursors.get(source, 0))
            picks: list[tuple[str, int]] = []
            for source, count in quotas:
                picks.extend((source, key) for key in mixer.take(source, state.streams[source], count))
                state.streams[source] += count
            out.picks = mixer.order(picks, iteration, batch_size)
            out.decision = DecisionRow("uniform", state.to_json(), mixed)
            return out
        tally = self.statistics.stages[stage]
        decision, parts = self.adaptive.draw(sampler, iteration, quotas, StageFeedback(tally.rolling, tally.graded))

        def steps() -> Iterator[None]:
            picks: list[tuple[str, int]] = []
            for part in parts:
                picks.extend(part)
                yield
            out.picks = mixer.order(picks, iteration, batch_size)
            out.decision = DecisionRow(
                decision.sampler, state.to_json(), {**decision.detail, **mixed}, sampler.served(decision)
            )

        out._steps = steps()
        return out

    def graded(self, rows: Sequence[GradeRow], stored: StoredGrades) -> tuple[list[GradeRow], set[int]]:
        """Fold in grades the state file just stored (``stored`` is what it did with ``rows``): the stage
        tallies, the per-record state and the timeline. Returns the rows counted now (not stored before) and
        the stages whose rolling reward moved."""
        new: list[tuple[GradeRow, GradeOutcome]] = [
            (row, status) for row, status in zip(rows, stored.outcomes, strict=True) if status != "exists"
        ]
        touched = self.statistics.graded(
            CountedGrade(row.stage, None if row.error is not None else row.reward, status == "replaced_error")
            for row, status in new
        )
        self.adaptive.graded(stored.items)
        self.adaptive.observe_groups(stored.groups)
        tallies = self.statistics.stages
        self.adaptive.prepare(lambda stage: StageFeedback(tallies[stage].rolling, tallies[stage].graded))
        self.timeline.graded(((row, status == "replaced_error") for row, status in new), stored.groups)
        return [row for row, _ in new], touched
