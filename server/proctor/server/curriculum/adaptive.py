"""The adaptive side of a curriculum: the per-record state, the samplers' state, the sampler of the stage
being served, and the learning-progress mixes of the stages that have one. Pure: the state file restores it,
the sampling service asks it for batches, the grade ledger tells it of new grades."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from proctor.server.curriculum.learning_progress import GroupSignal, LearningProgressMix
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.mixing import stage_weights
from proctor.server.curriculum.samplers import Decision, RecordSampler, SamplerState, StageFeedback, build_sampler
from proctor.server.sources.base import SampleId, Source
from proctor.server.spec import LearningProgressMixingSpec
from proctor.server.state.items import GroupState, ItemState, ItemStatistics, ItemTracking
from proctor.server.state.rows import GroupChange

__all__ = ["AdaptiveSampling", "finite_sizes", "groups_to_restore", "item_tracking", "learning_progress_mixes"]

# Records chosen per call into a sampler: a call costs tens of microseconds per record, and the sampling
# service hands the event loop back between calls.
_PER_CALL = 128


def finite_sizes(curriculum: Curriculum) -> dict[str, int]:
    """The sources that keep per-record state (the finite ones) and their sizes."""
    return {name: src.size for name, src in curriculum.sources.items() if src.size is not None}


def item_tracking(curriculum: Curriculum) -> ItemTracking:
    """What the state file folds grades into, for ``curriculum``."""
    spec = curriculum.spec
    return ItemTracking(
        pass_thresholds={name: src.pass_threshold for name, src in spec.sources.items()},
        finite=frozenset(finite_sizes(curriculum)),
        decay=spec.statistics.decay,
    )


def learning_progress_mixes(curriculum: Curriculum) -> dict[int, LearningProgressMix]:
    """A fresh mix for each stage whose mixing is ``learning_progress``, by stage."""
    return {
        i: LearningProgressMix(i, stage_weights(curriculum, i), spec.mixing.params)
        for i, spec in enumerate(curriculum.spec.stages)
        if isinstance(spec.mixing, LearningProgressMixingSpec)
    }


def groups_to_restore(curriculum: Curriculum) -> int:
    """How many of the latest graded groups a restart reads back to refill the mixes' windows (0 without one)."""
    return max((mix.restore_groups for mix in learning_progress_mixes(curriculum).values()), default=0)


class AdaptiveSampling:
    def __init__(self, curriculum: Curriculum, items: ItemStatistics, state: SamplerState) -> None:
        self.curriculum = curriculum
        self.items = items
        self.state = state
        # Only the latest stage's sampler is kept: its trees are a few numbers per record.
        self._live: tuple[int, RecordSampler] | None = None
        # Every learning-progress stage's mix from the start: it reads the groups of its sources whichever stage
        # served them, so a stage begins with what its sources taught before it.
        self.mixes = learning_progress_mixes(curriculum)

    def observe_groups(self, groups: Sequence[GroupChange]) -> None:
        """Groups that got grades: each learning-progress mix reads those of its sources."""
        if not self.mixes:
            return  # on every /grade: nothing to build when no stage mixes by learning progress
        self._observe([GroupSignal((g.iteration, g.sample_id, g.slot), g.source, g.after) for g in groups])

    def restore_mixes(self, groups: Sequence[tuple[int, str, int, GroupState]]) -> None:
        """The latest graded groups as the state file kept them, oldest first."""
        self._observe(
            [
                GroupSignal((iteration, sample_id, slot), SampleId.parse(sample_id).source, state)
                for iteration, sample_id, slot, state in groups
            ]
        )

    def _observe(self, signals: Sequence[GroupSignal]) -> None:
        for mix in self.mixes.values():
            mix.observe(signals)

    def kind(self, stage: int) -> str:
        return self.curriculum.spec.stages[stage].sampler.kind

    def sampler(self, stage: int) -> RecordSampler | None:
        """The stage's sampler; None for a ``uniform`` stage."""
        if self._live is not None and self._live[0] == stage:
            return self._live[1]
        spec = self.curriculum.spec.stages[stage].sampler
        names = [source for source, _ in stage_weights(self.curriculum, stage)]
        sources: dict[str, Source] = {name: self.curriculum.sources[name] for name in names}
        sampler = build_sampler(spec, stage, sources, self.items, self.state, self.curriculum.seed)
        if sampler is not None:
            self._live = (stage, sampler)
        return sampler

    def draw(
        self, sampler: RecordSampler, iteration: int, quotas: Sequence[tuple[str, int]], feedback: StageFeedback
    ) -> tuple[Decision, Iterator[list[tuple[str, int]]]]:
        """The iteration's decision, and its ``(source, key)`` picks a part at a time, source by source in the
        order of ``quotas`` (the caller may hand the event loop back between parts). The decision is complete
        once the parts are exhausted."""
        decision = Decision(sampler.kind)
        sampler.begin(iteration, feedback, decision)

        def parts() -> Iterator[list[tuple[str, int]]]:
            for source, count in quotas:
                part = 0
                while count > 0:
                    take = min(count, _PER_CALL)
                    yield [(source, key) for key in sampler.choose(source, take, iteration, decision, part)]
                    count -= take
                    part += 1

        return decision, parts()

    def prepare(self, feedback: Callable[[int], StageFeedback]) -> None:
        """After new grades: the live sampler may do now what its next iteration would (``feedback(stage)`` is
        what that iteration would read)."""
        if self._live is not None:
            stage, sampler = self._live
            sampler.prepare(feedback(stage))

    def graded(self, changes: Sequence[tuple[str, int, ItemState]]) -> None:
        """New per-record state from the state file: kept, and the live sampler's weights follow it."""
        live = self._live[1] if self._live is not None else None
        for source, key, state in changes:
            self.items.set(source, key, state)
            if live is not None and source in live.sources:
                live.item_changed(source, key)
