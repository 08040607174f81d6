"""The adaptive side of a curriculum: the per-record state, the samplers' state, and the sampler of the stage
being served. Pure: the state file restores it, the sampling service asks it for batches, the grade ledger
tells it of new grades."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.mixing import stage_weights
from proctor.server.curriculum.samplers import Decision, RecordSampler, SamplerState, StageFeedback, build_sampler
from proctor.server.sources.base import Source
from proctor.server.state.items import ItemState, ItemStatistics, ItemTracking

__all__ = ["AdaptiveSampling", "finite_sizes", "item_tracking"]

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


class AdaptiveSampling:
    def __init__(self, curriculum: Curriculum, items: ItemStatistics, state: SamplerState) -> None:
        self.curriculum = curriculum
        self.items = items
        self.state = state
        # Only the latest stage's sampler is kept: its trees are a few numbers per record.
        self._live: tuple[int, RecordSampler] | None = None

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

    def graded(self, changes: Sequence[tuple[str, int, ItemState]]) -> None:
        """New per-record state from the state file: kept, and the live sampler's weights follow it."""
        live = self._live[1] if self._live is not None else None
        for source, key, state in changes:
            self.items.set(source, key, state)
            if live is not None and source in live.sources:
                live.item_changed(source, key)
