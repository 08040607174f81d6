"""``GET /meta``, ``GET /curriculum``, ``GET /dashboard`` and ``GET /stats/{iteration}``: what the server serves,
where its curriculum stands, and what it counted of each step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from proctor.server import __version__
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.progress import CurriculumProgress
from proctor.server.settings import Settings
from proctor.server.state.items import PASS_RATE_BINS, GroupState, ItemState
from proctor.wire import dataserver as wire

__all__ = ["curriculum_state", "dashboard", "graders", "meta", "step_stats"]


def meta(curriculum: Curriculum, settings: Settings) -> wire.Meta:
    c = curriculum
    return wire.Meta(
        total_iterations=c.total_iterations,
        stages=[wire.StageInfo(name=s.name, until_step=s.until_step) for s in c.stages],
        curriculum=c.name,
        curriculum_hash=c.hash,
        seed=c.seed,
        run=settings.run_name(c.name, c.hash),
        sources=[
            wire.SourceInfo(
                name=name, kind=src.kind, version=src.version, size=src.size, graders=list(c.graders[name].names)
            )
            for name, src in c.sources.items()
        ],
        max_batch_size=settings.max_batch_size,
        max_grade_items=settings.max_grade_items,
        max_body_bytes=settings.max_body_bytes,
        version=__version__,
    )


def graders(curriculum: Curriculum, settings: Settings) -> wire.Graders:
    # Remote graders' headers often carry credentials: they go out only behind this server's own key.
    withheld = settings.api_key is None
    return wire.Graders(
        curriculum_hash=curriculum.hash,
        timeout_s=settings.grader_timeout_s,
        headers_withheld=withheld,
        sources={
            name: wire.SourceGradersSpec(
                local=[
                    wire.LocalGraderSpec(
                        key=g.key, ref=g.ref, params=dict(g.params), weight=g.weight, multiplicative=g.multiplicative
                    )
                    for g in sg.local
                ],
                remote=[
                    wire.RemoteGraderSpec(
                        key=g.key,
                        url=g.url,
                        timeout_s=g.timeout_s,
                        headers={k: "" if withheld else v for k, v in g.headers.items()},
                        params=dict(g.params),
                        weight=g.weight,
                        multiplicative=g.multiplicative,
                    )
                    for g in sg.remote
                ],
                on_error=sg.on_error,
                names=list(sg.names),
                # Every field but the judges' API key, which a grade-worker takes from its own settings.
                judges=[wire.JudgeGraderSpec(**dataclasses.asdict(g)) for g in sg.judges],
            )
            for name, sg in curriculum.graders.items()
        },
    )


# The latest iterations of a learning-progress stage whose weights `GET /curriculum` lists.
MIX_HISTORY = 64


def _mixing(progress: CurriculumProgress, stage: int) -> dict[str, Any]:
    """What ``GET /curriculum`` shows of a stage's mixing: its kind, and a learning-progress stage's weights now,
    its sources' signals and its latest iterations' weights."""
    mix = progress.adaptive.mixes.get(stage)
    if mix is None:
        return {}
    history = [
        wire.MixPoint(iteration=t.iteration, weights=t.mix_weights)
        for t in progress.timeline.tallies()
        if t.stage == stage and t.mix_weights is not None
    ]
    return {
        "mixing": "learning_progress",
        "mix_weights": mix.weights(),
        "learning_signals": mix.signals(),
        "mix_history": history[-MIX_HISTORY:],
    }


def curriculum_state(progress: CurriculumProgress) -> wire.CurriculumState:
    c, schedule = progress.curriculum, progress.schedule
    starts: dict[int, int] = {0: 0}
    for t in schedule.transitions:
        starts[t.to_stage] = t.iteration
    current = schedule.current
    stages = [
        wire.StageState(
            name=s.name,
            index=s.index,
            until_step=s.until_step,
            started_at=starts.get(s.index) if s.index <= current else None,
            advance=s.advance.model_dump() if s.advance else None,
            refill=s.refill.model_dump() if s.refill else None,
            iterations=tally.iterations,
            samples=tally.samples,
            graded=tally.graded,
            errors=tally.errors,
            mean_reward=tally.mean,
            rolling_reward=tally.rolling,
            rolling_count=len(tally.window),
            sampler=c.spec.stages[s.index].sampler.kind,
            **_mixing(progress, s.index),
        )
        for s, tally in zip(c.stages, progress.statistics.stages, strict=True)
    ]
    return wire.CurriculumState(
        curriculum=c.name,
        curriculum_hash=c.hash,
        current_stage=c.stages[current].name,
        current_stage_index=current,
        last_iteration=progress.last_iteration,
        total_iterations=c.total_iterations,
        transitions=[
            wire.Transition(
                iteration=t.iteration,
                from_stage=c.stages[t.from_stage].name,
                to_stage=c.stages[t.to_stage].name,
                reason=t.reason,
                rolling_reward=t.rolling_reward,
                rolling_count=t.rolling_count,
            )
            for t in schedule.transitions
        ],
        stages=stages,
    )


def dashboard(progress: CurriculumProgress) -> wire.Dashboard:
    state = curriculum_state(progress)
    c = progress.curriculum
    items = progress.adaptive.items
    pass_rates = []
    for name, src in c.sources.items():
        if items.tracks(name):
            graded, bins, mean = items.histogram(name)
        else:
            graded, bins, mean = 0, [0] * PASS_RATE_BINS, None
        pass_rates.append(
            wire.PassRateHistogram(source=name, records=src.size, graded_records=graded, bins=bins, mean_pass_rate=mean)
        )
    return wire.Dashboard(
        curriculum=state.curriculum,
        current_stage=state.current_stage,
        last_iteration=state.last_iteration,
        total_iterations=state.total_iterations,
        stages=state.stages,
        transitions=state.transitions,
        iterations=[
            wire.IterationPoint(
                iteration=t.iteration,
                stage=c.stages[t.stage].name,
                stage_index=t.stage,
                graded=t.graded,
                errors=t.errors,
                mean_reward=t.mean_reward,
                groups=t.groups,
                zero_variance_groups=t.zero_variance_groups,
                mix_weights=t.mix_weights,
                refill_rounds=t.refill_rounds,
                refilled_groups=t.refilled_groups,
            )
            for t in progress.timeline.tallies()
        ],
        pass_rates=pass_rates,
        grader_errors=sum(tally.errors for tally in progress.statistics.stages),
        recent_errors=[
            wire.GraderErrorEntry(iteration=i, sample_id=sid, error=error) for i, sid, error in progress.timeline.errors
        ],
    )


def step_stats(
    iteration: int,
    stage: str,
    groups: Sequence[tuple[str, int, GroupState]],
    truncated: bool,
    records: Mapping[str, ItemState],
) -> wire.StepStats:
    """``GET /stats/{iteration}`` from the step's stored groups and their records' state (by sample id)."""
    return wire.StepStats(
        iteration=iteration,
        stage=stage,
        groups=[
            wire.GroupStats(
                slot=None if slot < 0 else slot,
                sample_id=sample_id,
                graded=g.n,
                mean_reward=g.mean,
                reward_std=math.sqrt(g.m2 / g.n) if g.n else 0.0,
            )
            for sample_id, slot, g in groups
        ],
        truncated=truncated,
        records=[
            wire.RecordStats(
                sample_id=sample_id,
                passes=r.passes,
                fails=r.fails,
                groups=r.groups,
                streak=r.streak,
                last_iteration=None if r.last_group[0] < 0 else r.last_group[0],
            )
            for sample_id, r in records.items()
        ],
    )
