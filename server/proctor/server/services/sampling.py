"""The sampling service: ``POST /sample``, the prompts of one generation step, decided once and served alike
to every rank, retry and restart.

A new iteration is decided in memory (its stage, then its draw) and committed right after, in a group
commit with the other new iterations of the moment; every request for it waits for that commit, so nothing
reaches a client before it is on disk. Committed batches are kept, encoded, in a bounded cache.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from proctor.server.curriculum.mixing import Mixer
from proctor.server.exceptions import ConflictError, InvalidRequestError
from proctor.server.pacing import paced
from proctor.server.services.batches import SampleCache, ServedBatch, encode_sample
from proctor.server.services.context import ServingContext
from proctor.server.state.rows import IterationRow
from proctor.wire import dataserver as wire

__all__ = ["SamplingService"]


class SamplingService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.mixer = Mixer(ctx.curriculum)
        self.cache = SampleCache(ctx.settings.sample_cache, ctx.settings.sample_cache_bytes)
        self._lock = asyncio.Lock()
        # Iterations decided but not yet committed, with the future of their commit.
        self._pending: dict[int, tuple[ServedBatch, asyncio.Future[None]]] = {}

    async def sample(self, req: wire.SampleRequest) -> bytes:
        """The JSON of :class:`~proctor.wire.dataserver.SampleResponse` for ``req.iteration`` (or the rank's
        share of it), creating the batch on first request."""
        limit = self.ctx.settings.max_batch_size
        if req.batch_size > limit:
            raise InvalidRequestError(
                "batch_size", f"{req.batch_size} is above this server's maximum of {limit} (PROCTOR_MAX_BATCH_SIZE)"
            )
        if req.world_size is not None and req.batch_size % req.world_size:
            raise InvalidRequestError(
                "batch_size",
                f"{req.batch_size} prompts cannot be split evenly over world_size {req.world_size}; "
                "send the step's prompts across all ranks, a multiple of world_size",
            )
        self.ctx.storage.check_healthy()
        batch, committed = self._pending.get(req.iteration, (self.cache.get(req.iteration), None))
        if batch is None:
            async with self._lock:
                batch, committed = self._pending.get(req.iteration, (None, None))
                if batch is None:
                    batch = await self._stored(req.iteration)
                if batch is None:
                    self._check_reach(req.iteration)
                    batch, committed = await self._new_iteration(req.iteration, req.batch_size)
        if committed is not None:
            # Nobody gets a batch before it is on disk: the answer must survive a crash. A failed commit
            # raises UnavailableError (503) here.
            await asyncio.shield(committed)
        if batch.batch_size != req.batch_size:
            raise ConflictError(
                f"iteration {req.iteration} was sampled with batch_size {batch.batch_size}; ask again with "
                f"batch_size {batch.batch_size} (rank and world_size select a share of it), or use another iteration"
            )
        return batch.response(req.rank, req.world_size)

    def _check_reach(self, iteration: int) -> None:
        """A new iteration may lie at most ``max_iteration_leap`` past the latest one sampled."""
        last = self.ctx.progress.last_iteration
        leap = self.ctx.settings.max_iteration_leap
        if iteration > (-1 if last is None else last) + leap:
            latest = "none was sampled yet" if last is None else f"the latest sampled is {last}"
            raise InvalidRequestError(
                "iteration",
                f"{iteration} is more than {leap} iterations past the run's latest ({latest}); ask for the "
                "generation steps in order, or raise PROCTOR_MAX_ITERATION_LEAP",
            )

    async def sample_ids(self, iteration: int) -> tuple[str, ...] | None:
        """The sample id in each slot of ``iteration``; None if it was never sampled."""
        batch = await self.served(iteration)
        return None if batch is None else batch.sample_ids

    async def served(self, iteration: int) -> ServedBatch | None:
        """The batch of ``iteration`` (decided, perhaps not yet committed); None if it was never sampled."""
        pending = self._pending.get(iteration)
        return pending[0] if pending is not None else await self._stored(iteration)

    async def _new_iteration(self, iteration: int, batch_size: int) -> tuple[ServedBatch, asyncio.Future[None]]:
        """Decide and draw a new iteration, and queue it for the next group commit."""
        draw = self.ctx.progress.draw(iteration, batch_size, self.mixer)
        # An adaptive stage chooses its records a part at a time: the loop is handed back between parts.
        for _ in draw.steps():
            await asyncio.sleep(0)
        stage, transitions, picks = draw.stage, draw.transitions, draw.picks
        # Records are built and encoded a slice at a time (a generated one costs tens of microseconds); the
        # lock is held meanwhile, so every other request for a new iteration waits for this one.
        samples: list[dict[str, Any]] = []
        encoded: list[bytes] = []
        async for source, key in paced(picks):
            samples.append(self.sample_dict(source, key))
            encoded.append(encode_sample(len(encoded), samples[-1]))
        stage_name = self.ctx.curriculum.stages[stage].name
        ids = tuple(s["sample_id"] for s in samples)
        batch = ServedBatch(iteration, batch_size, stage, stage_name, tuple(encoded), ids, self.refill_rounds(stage))
        row = IterationRow(iteration, batch_size, stage, samples, draw.decision)
        committed = self.ctx.storage.record_iteration(row, transitions, batch.samples_json())
        self._pending[iteration] = (batch, committed)
        committed.add_done_callback(lambda fut: self._on_committed(batch, fut))

        for source, count in Counter(source for source, _ in picks).items():
            self.ctx.metrics.samples.labels(stage_name, source).inc(count)
        assert self.ctx.progress.last_iteration is not None
        self.ctx.metrics.last_iteration.set(self.ctx.progress.last_iteration)
        if transitions:
            self.ctx.metrics.transitions.inc(len(transitions))
            self.ctx.metrics.publish_stage(self.ctx.curriculum.stage_names, self.ctx.progress.schedule.current)
        return batch, committed

    async def _stored(self, iteration: int) -> ServedBatch | None:
        """A committed iteration: from the cache, or read back from the store (and cached)."""
        batch = self.cache.get(iteration)
        # Only iterations up to the highest one sampled can be in the store.
        last = self.ctx.progress.last_iteration
        if batch is None and last is not None and iteration <= last:
            row = await self.ctx.storage.get_iteration(iteration)
            if row is not None:
                stage = self.ctx.curriculum.stages[row.stage]
                batch = ServedBatch.of(row, stage.name, self.refill_rounds(row.stage))
                self.cache.put(batch)
        return batch

    def _on_committed(self, batch: ServedBatch, fut: asyncio.Future[None]) -> None:
        self._pending.pop(batch.iteration, None)
        if not fut.cancelled() and fut.exception() is None:
            self.cache.put(batch)

    def refill_rounds(self, stage: int) -> int:
        """The refill rounds a stage allows (0: it refills nothing)."""
        refill = self.ctx.curriculum.stages[stage].refill
        return 0 if refill is None else refill.max_rounds

    def refilled(self, batch: ServedBatch) -> None:
        """Serve ``batch`` from now on: a committed one that a refill round extended (and stored)."""
        self.cache.put(batch)

    def sample_dict(self, source: str, key: int) -> dict[str, Any]:
        """A record as the store keeps it among an iteration's samples."""
        src = self.ctx.curriculum.sources[source]
        record = src.record(key)
        return {
            "sample_id": src.sample_id(key),
            "dataset_id": source,
            "system_prompt": record.system_prompt or self.ctx.curriculum.system_prompt,
            "prompt": record.prompt,
            "metadata": dict(record.metadata),
        }
