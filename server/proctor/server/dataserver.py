"""The composition root: the state file, the grader processes and the curriculum's progress, wired into the
sampling and grading services that the routes call.

Everything runs on the event loop except the graders (worker processes), WAL checkpoints (a thread), store
writes of the state file and the experience store, which shares its file (the store's thread; see
:mod:`proctor.server.storage`). Per-item Python work that grows with a request's size hands the loop back every
few milliseconds (:mod:`proctor.server.pacing`); a request's inline store calls do not, and are bounded by its
item limit instead (a statement per few hundred keys).

The grader processes are the experience store's grader role (:mod:`proctor.server.services.grader_role`); with
``PROCTOR_GRADER_WORKERS=0`` there are none, and remote ``proctor grade-worker`` processes take the role.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import httpx

from proctor.experience.columns import GRADER
from proctor.server.curriculum.adaptive import finite_sizes, groups_to_restore, item_tracking
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.progress import CurriculumProgress
from proctor.server.curriculum.samplers import SamplerState
from proctor.server.curriculum.statistics import window_size
from proctor.server.curriculum.timeline import RECENT_ERRORS, TIMELINE_ITERATIONS
from proctor.server.exceptions import NotFoundError
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import local_refs
from proctor.server.metrics import Metrics
from proctor.server.services import views
from proctor.server.services.context import ServingContext
from proctor.server.services.experience import AsyncExperienceStore
from proctor.server.services.grader_role import GraderRole
from proctor.server.services.grading import GradingContext, GradingService
from proctor.server.services.history import adopt_history, read_history
from proctor.server.services.ledger import GradeLedger
from proctor.server.services.refills import RefillService
from proctor.server.services.rollouts import Rollouts
from proctor.server.services.sampling import SamplingService
from proctor.server.services.scoring import ScoringService
from proctor.server.settings import Settings, SettingsError
from proctor.server.sources.base import SampleId
from proctor.server.state.rows import StageTotals
from proctor.server.storage import AsyncStore
from proctor.server.store import Store
from proctor.wire import dataserver as wire

__all__ = ["Dataserver"]


class Dataserver:
    """Create with :meth:`open`, release with :meth:`close`."""

    def __init__(
        self,
        ctx: ServingContext,
        pool: GraderPool | None,
        http: httpx.AsyncClient,
        experience: AsyncExperienceStore,
        peer_token: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.experience = experience
        self.peer_token = peer_token
        """What a standby of this server's PostgreSQL database sends with the completions it graded (None on
        SQLite, which has no standbys)."""
        self._pool = pool
        self._http = http
        self.sampling = SamplingService(ctx)
        ledger = GradeLedger(ctx)
        self.rollouts = Rollouts(ctx, experience, self.sampling, ledger)
        self.refills = RefillService(ctx, self.rollouts)
        timeout_s = ctx.settings.grader_timeout_s
        judge_key = ctx.settings.judge_api_key
        fanout = GraderFanout(pool, http, ctx.metrics, timeout_s, judge_api_key=judge_key) if pool is not None else None
        self._fanout = fanout
        grading = GradingContext(ctx.curriculum, ctx.settings, ctx.metrics, ctx.storage, self.rollouts)
        self.grading = GradingService(grading, fanout)
        self.scoring = ScoringService(ctx, self.grading, fanout)
        # Without local grader processes the role is left to remote grade-workers.
        self.grader_role = GraderRole(self.rollouts, fanout) if fanout is not None else None

    @classmethod
    async def open(cls, curriculum: Curriculum, settings: Settings, metrics: Metrics) -> Dataserver:
        """Open (or create) the state file, restore the curriculum's progress from it, start the graders."""
        default = settings.peer_default_source
        if default is not None and default not in curriculum.sources:
            raise SettingsError(
                "invalid configuration:\n  PROCTOR_PEER_DEFAULT_SOURCE (peer_default_source): "
                f"{default!r} is not a source of curriculum {curriculum.name!r}; its sources are: "
                + ", ".join(sorted(curriculum.sources))
            )
        adopt: Callable[[Store], None] | None = None
        if settings.transitions is not None:
            history = read_history(settings.transitions, curriculum)
            adopt = functools.partial(adopt_history, history=history, source=str(settings.transitions))
        storage = await AsyncStore.open(
            settings,
            curriculum=curriculum.name,
            curriculum_hash=curriculum.hash,
            seed=curriculum.seed,
            tracking=item_tracking(curriculum),
            adopt=adopt,
        )
        experience: AsyncExperienceStore | None = None
        peer_token: str | None = None
        try:
            if storage.reopens:  # a PostgreSQL database, which other servers may stand by for
                peer_token = await storage.write(storage.store.announce, settings.advertised_url())
            progress = await _restore(curriculum, storage)
            experience = await AsyncExperienceStore.open(settings, storage)
            g = GRADER
            await experience.call(experience.store.register, g.name, needs=g.needs, produces=g.produces)
            pool = None
            if settings.grader_workers > 0:
                pool = GraderPool(settings.grader_workers, graders=local_refs(curriculum.graders))
                await pool.start()
        except BaseException:
            if experience is not None:
                await experience.close()
            await storage.close()
            raise
        metrics.publish_stage(curriculum.stage_names, progress.schedule.current)
        if progress.last_iteration is not None:
            metrics.last_iteration.set(progress.last_iteration)
        http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False)
        server = cls(
            ServingContext(curriculum, settings, metrics, storage, progress), pool, http, experience, peer_token
        )
        try:
            await server.rollouts.recover()
        except BaseException:
            await server.close()
            raise
        if server.grader_role is not None:
            server.grader_role.start()
        return server

    async def close(self) -> None:
        if self.grader_role is not None:
            await self.grader_role.close()
        if self._pool is not None:
            await self._pool.close()
        if self._fanout is not None:
            await self._fanout.aclose()
        await self._http.aclose()
        await self.rollouts.close()
        await self.experience.close()
        await self.ctx.storage.close()

    @property
    def last_iteration(self) -> int | None:
        return self.ctx.progress.last_iteration

    def meta(self) -> wire.Meta:
        return views.meta(self.ctx.curriculum, self.ctx.settings)

    def curriculum_state(self) -> wire.CurriculumState:
        return views.curriculum_state(self.ctx.progress)

    def dashboard(self) -> wire.Dashboard:
        return views.dashboard(self.ctx.progress)

    async def step_stats(self, iteration: int) -> wire.StepStats:
        """A step's groups as the curriculum counted them, and their records' state (tracked sources)."""
        ctx = self.ctx
        limit = 2 * ctx.settings.max_batch_size  # the step's slots, and as many groups graded outside them
        groups = await ctx.storage.step_groups(iteration, limit + 1)
        last = ctx.progress.last_iteration
        if not groups and (last is None or iteration > last):
            raise NotFoundError(
                f"iteration {iteration} was never sampled and has no grades; the latest sampled is "
                f"{'none' if last is None else last}"
            )
        tracked = finite_sizes(ctx.curriculum)
        ids = {sample_id: SampleId.parse(sample_id) for sample_id, _, _ in groups[:limit]}
        keys = {sid: (p.source, p.key) for sid, p in ids.items() if p.source in tracked}
        states = await ctx.storage.records(keys.values())
        records = {sid: states[key] for sid, key in keys.items() if key in states}
        stage = ctx.curriculum.stages[ctx.progress.stage_of(iteration)].name
        return views.step_stats(iteration, stage, groups[:limit], len(groups) > limit, records)


async def _restore(curriculum: Curriculum, storage: AsyncStore) -> CurriculumProgress:
    stored = await storage.stored_progress(
        len(curriculum.stages),
        lambda stage: window_size(curriculum.stages[stage]),
        finite_sizes(curriculum),
        (TIMELINE_ITERATIONS, RECENT_ERRORS),
        groups=groups_to_restore(curriculum),
    )
    progress = CurriculumProgress.start(
        curriculum,
        transitions=stored.transitions,
        decided_through=stored.decided_through,
        last_iteration=stored.last_iteration,
        sampler_state=SamplerState.from_json(stored.sampler_state) if stored.sampler_state is not None else None,
    )
    for stage in range(len(curriculum.stages)):
        t = stored.totals.get(stage, StageTotals())
        progress.statistics.restore(
            stage,
            iterations=t.iterations,
            samples=t.samples,
            graded=t.graded,
            errors=t.errors,
            reward_sum=t.reward_sum,
            recent=stored.recent_rewards.get(stage, []),
        )
    for source, rows in stored.items.items():
        progress.adaptive.items.restore(source, rows)
    progress.adaptive.restore_mixes(stored.groups)
    mix_weights = {
        iteration: detail["mix"]["weights"] for iteration, (_, detail) in stored.decisions.items() if "mix" in detail
    }
    progress.timeline.restore(stored.iterations, stored.recent_errors, mix_weights, stored.refills)
    return progress
