"""The dataserver's two data paths, sample and grade, over the curriculum, the store and the grader pool.

Routes are thin: they validate the wire model and call :class:`Dataserver`. Everything here runs on the
event loop except the graders (worker processes), WAL checkpoints (a thread), and store calls that may be
slow (a dedicated thread; see :meth:`Dataserver._quick` for which calls run where). Work that grows with a
request's size (records of a large batch, items of a large /grade) hands the event loop back every few
milliseconds, so that no request keeps the others waiting for long.

Nothing reaches a client before the store has committed it. A new iteration is decided in memory first
and committed right after, and every request for it waits for that commit; should the commit fail, the
server refuses all further work (503) instead of serving from a memory that is ahead of its state file.
Grading statistics follow the commit of the grades they count.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import httpx

from proctor.server import __version__
from proctor.server import protocol as wire
from proctor.server.curriculum.engine import StageSchedule, TransitionRecord
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.mixing import Mixer
from proctor.server.errors import ConflictError, InvalidRequestError, UnavailableError
from proctor.server.grading.base import GradeInput
from proctor.server.grading.pool import GraderPool, GraderPoolError, GraderTimeout
from proctor.server.grading.registry import RemoteGrader, SourceGraders
from proctor.server.grading.remote import RemoteFailure, grade_remote
from proctor.server.history import adopt_history, read_history
from proctor.server.metrics import Metrics
from proctor.server.settings import Settings
from proctor.server.sources.base import Record, SampleId
from proctor.server.store import NO_SLOT, GradeKey, GradeOutcome, GradeRow, IterationRow, Store

__all__ = ["Dataserver"]

log = logging.getLogger("proctor")

P = ParamSpec("P")
T = TypeVar("T")


_DEFAULT_WINDOW = 64  # rolling window shown for stages without a gate
# One compact encoder: json.dumps(..., ensure_ascii=False) builds one per call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_CHECKPOINT_EVERY_S = 0.5
# Per-item work on a large request hands the event loop back this often, so that no request holds it for
# long whatever its size. A request needs several turns of the loop to be answered, so the turns are short.
_PACE_S = 0.002
_GRADES_PER_COMMIT = 256
_WAL_RESTART_FRAMES = 8192  # 32 MiB of 4 KiB pages


async def _paced(items: Iterable[T]) -> AsyncIterator[T]:
    """``items``, handing the event loop back whenever ``_PACE_S`` has passed since it last had it."""
    turn = time.perf_counter()
    for item in items:
        yield item
        if time.perf_counter() - turn > _PACE_S:
            await asyncio.sleep(0)
            turn = time.perf_counter()


@dataclass(slots=True)
class _StageStats:
    window: deque[float]
    iterations: int = 0
    samples: int = 0
    graded: int = 0
    errors: int = 0
    reward_sum: float = 0.0

    @property
    def rolling(self) -> float | None:
        return sum(self.window) / len(self.window) if self.window else None


@dataclass(frozen=True, slots=True)
class _Batch:
    """A sampled iteration as it is served: each sample already encoded as JSON, with its slot."""

    iteration: int
    batch_size: int
    stage: int
    stage_name: str
    samples: tuple[bytes, ...]
    sample_ids: tuple[str, ...]  # by slot

    @property
    def size(self) -> int:
        """Bytes of encoded samples, what the sample cache counts."""
        return sum(map(len, self.samples))

    @classmethod
    def of(cls, row: IterationRow, curriculum: Curriculum) -> _Batch:
        encoded = tuple(_encode_sample(slot, s) for slot, s in enumerate(row.samples))
        ids = tuple(s["sample_id"] for s in row.samples)
        return cls(row.iteration, row.batch_size, row.stage, curriculum.stages[row.stage].name, encoded, ids)


def _encode_sample(slot: int, sample: dict[str, Any]) -> bytes:
    # The slot is the sample's position, so it is added here rather than stored (state files of earlier
    # versions have none).
    return _JSON.encode({"sample_id": sample["sample_id"], "slot": slot, **sample}).encode()


@dataclass(slots=True)
class _Item:
    """One /grade item after validation."""

    sample_id: str
    slot: int | None
    completion_index: int
    completion: str
    completion_tokens: int | None
    source: str
    record: Record | None  # None when the id is stale (its source changed)
    key: GradeKey = (0, "", NO_SLOT, 0, "")
    stage: int = 0
    scores: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Dataserver:
    """Owns the curriculum's live state. Create with :meth:`open`, release with :meth:`close`."""

    def __init__(
        self,
        curriculum: Curriculum,
        settings: Settings,
        metrics: Metrics,
        store: Store,
        pool: GraderPool,
        http: httpx.AsyncClient,
        db_thread: ThreadPoolExecutor,
    ) -> None:
        self.curriculum = curriculum
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.pool = pool
        self.http = http
        self._db_thread = db_thread
        self.mixer = Mixer(curriculum)
        self.schedule = StageSchedule(curriculum.stages)
        self.last_iteration: int | None = None
        self._stats = [
            _StageStats(deque(maxlen=s.advance.window if s.advance else _DEFAULT_WINDOW)) for s in curriculum.stages
        ]
        self._cache: OrderedDict[int, _Batch] = OrderedDict()
        self._cache_bytes = 0
        self._sample_lock = asyncio.Lock()
        # Iterations decided but not yet committed, with the write that commits them.
        self._pending: dict[int, tuple[_Batch, asyncio.Future[None]]] = {}
        self.failure: str | None = None
        self._checkpoints: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, curriculum: Curriculum, settings: Settings, metrics: Metrics) -> Dataserver:
        """Open (or create) the state file, restore the curriculum's state from it, start the graders."""
        db_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proctor-store")
        loop = asyncio.get_running_loop()
        store = await loop.run_in_executor(db_thread, lambda: Store(settings.state, synchronous=settings.state_sync))
        try:
            await loop.run_in_executor(
                db_thread,
                lambda: store.bind(curriculum=curriculum.name, curriculum_hash=curriculum.hash, seed=curriculum.seed),
            )
            if settings.transitions is not None:
                history = read_history(settings.transitions, curriculum)
                source = str(settings.transitions)
                await loop.run_in_executor(db_thread, lambda: adopt_history(store, history, source=source))
            pool = GraderPool(settings.grader_workers)
            await pool.start()
        except BaseException:
            await loop.run_in_executor(db_thread, store.close)
            db_thread.shutdown()
            raise
        http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), follow_redirects=False)
        server = cls(curriculum, settings, metrics, store, pool, http, db_thread)
        await server._restore()
        server._checkpoints = asyncio.create_task(server._checkpoint_forever())
        return server

    async def _checkpoint_forever(self) -> None:
        """Keep the WAL short, on a thread of its own so that writes never wait for the copying."""
        while True:
            await asyncio.sleep(_CHECKPOINT_EVERY_S)
            try:
                await asyncio.to_thread(self.store.checkpoint, restart_after_frames=_WAL_RESTART_FRAMES)
            except Exception:  # a busy or failing checkpoint is retried; writes report their own failures
                log.exception("WAL checkpoint failed")

    async def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpoints
        await self.pool.close()
        await self.http.aclose()
        await self._db(self.store.close)
        self._db_thread.shutdown(wait=True)

    async def _db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a store call on the store thread: for calls that may be slow (scans, fsyncs)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db_thread, lambda: fn(*args, **kwargs))

    def _quick(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
        """Run a short store call (indexed reads, commits without fsync) right here, or on the store thread
        when commits fsync (``PROCTOR_STATE_SYNC=full``). The result comes as a future either way.

        Inline, a commit costs tens of microseconds; through a thread it costs a hop and a wait for the GIL
        that the busy event loop holds, which under load was most of /sample's latency.
        """
        if self.settings.state_sync == "full":
            return asyncio.ensure_future(self._db(fn, *args, **kwargs))
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    async def _restore(self) -> None:
        self.schedule = StageSchedule(
            self.curriculum.stages,
            await self._db(self.store.transitions),
            decided_through=await self._db(self.store.decided_through),
        )
        self.last_iteration = await self._db(self.store.last_iteration)
        totals = await self._db(self.store.stage_totals)
        for index, stats in enumerate(self._stats):
            t = totals.get(index)
            if t is not None:
                stats.iterations, stats.samples = t.iterations, t.samples
                stats.graded, stats.errors, stats.reward_sum = t.graded, t.errors, t.reward_sum
            assert stats.window.maxlen is not None
            stats.window.extend(await self._db(self.store.recent_rewards, index, stats.window.maxlen))
        self._publish_stage_metrics()
        if self.last_iteration is not None:
            self.metrics.last_iteration.set(self.last_iteration)

    # --- sample -----------------------------------------------------------------------------------------

    async def sample(self, req: wire.SampleRequest) -> bytes:
        """The JSON of :class:`~proctor.server.protocol.SampleResponse` for ``req.iteration`` (or the rank's
        share of it), creating the batch on first request.

        Bytes rather than a model: the samples of a batch are encoded once, when the batch is made or
        loaded, so the repeats (every other rank, every retry) cost a join instead of a serialisation.
        """
        limit = self.settings.max_batch_size
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
        self._check_healthy()
        batch, committed = self._pending.get(req.iteration, (self._cache_get(req.iteration), None))
        if batch is None:
            async with self._sample_lock:
                batch, committed = self._pending.get(req.iteration, (None, None))
                if batch is None:
                    batch = await self._stored_batch(req.iteration)
                if batch is None:
                    batch, committed = await self._new_iteration(req.iteration, req.batch_size)
        if committed is not None:
            # Nobody gets a batch before it is on disk: the answer must survive a crash.
            try:
                await asyncio.shield(committed)
            except Exception as exc:
                raise UnavailableError(self.failure or f"the state file refused a write ({exc})") from exc
        if batch.batch_size != req.batch_size:
            raise ConflictError(
                f"iteration {req.iteration} was sampled with batch_size {batch.batch_size}; ask again with "
                f"batch_size {batch.batch_size} (rank and world_size select a share of it), or use another iteration"
            )
        samples = batch.samples
        if req.rank is not None and req.world_size is not None:
            share = batch.batch_size // req.world_size
            samples = samples[req.rank * share : (req.rank + 1) * share]
        tail = _JSON.encode(
            {
                "stage": batch.stage_name,
                "stage_index": batch.stage,
                "iteration": batch.iteration,
                "batch_size": batch.batch_size,
                "rank": req.rank,
                "world_size": req.world_size,
            }
        )
        return b'{"samples":[' + b",".join(samples) + b"]," + tail[1:].encode()

    async def _new_iteration(self, iteration: int, batch_size: int) -> tuple[_Batch, asyncio.Future[None]]:
        """Decide and draw a new iteration, and start storing it.

        Memory moves first and the write follows (at once with ``synchronous=NORMAL``; on the store thread
        with ``full``, so that the next new iteration can be decided while this one waits for its fsync;
        writes stay in order). Callers wait for the returned future before answering; if a write fails the
        server stops serving (503) rather than answer from a memory that is ahead of its state file.
        """
        transitions: list[TransitionRecord] = []
        if self.last_iteration is None or iteration > self.last_iteration:
            transitions = self.schedule.decide(iteration, self._gate_view)
        self.schedule.apply(transitions)
        stage = self.schedule.stage_of(iteration)
        picks = self.mixer.draw(iteration, batch_size, self.schedule.stage_of)
        # Records are built and encoded a slice at a time (a generated one costs tens of microseconds); the
        # sample lock is held meanwhile, so every other request for a new iteration waits for this one.
        samples: list[dict[str, Any]] = []
        encoded: list[bytes] = []
        async for source, key in _paced(picks):
            samples.append(self._sample_dict(source, key))
            encoded.append(_encode_sample(len(encoded), samples[-1]))
        row = IterationRow(iteration, batch_size, stage, samples)
        stage_name = self.curriculum.stages[stage].name
        batch = _Batch(iteration, batch_size, stage, stage_name, tuple(encoded), tuple(s["sample_id"] for s in samples))
        samples_json = "[" + ",".join(s.decode() for s in batch.samples) + "]"
        committed = self._quick(self.store.record_iteration, row, transitions, samples_json=samples_json)
        self._pending[iteration] = (batch, committed)
        if committed.done():
            self._on_committed(batch, committed)
        else:
            committed.add_done_callback(lambda fut: self._on_committed(batch, fut))

        self.last_iteration = iteration if self.last_iteration is None else max(self.last_iteration, iteration)
        stats = self._stats[stage]
        stats.iterations += 1
        stats.samples += batch_size
        for source, count in Counter(source for source, _ in picks).items():
            self.metrics.samples.labels(stage_name, source).inc(count)
        self.metrics.last_iteration.set(self.last_iteration)
        if transitions:
            self.metrics.transitions.inc(len(transitions))
            self._publish_stage_metrics()
        return batch, committed

    async def _stored_batch(self, iteration: int) -> _Batch | None:
        """A committed iteration: from the cache, or read back from the store (and cached)."""
        batch = self._cache_get(iteration)
        # Only iterations up to the highest one sampled can be in the store.
        if batch is None and self.last_iteration is not None and iteration <= self.last_iteration:
            row = await self._quick(self.store.get_iteration, iteration)
            if row is not None:
                batch = _Batch.of(row, self.curriculum)
                self._cache_put(batch)
        return batch

    def _on_committed(self, batch: _Batch, fut: asyncio.Future[None]) -> None:
        self._pending.pop(batch.iteration, None)
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is None:
            self._cache_put(batch)
            return
        self._fail(exc)

    def _fail(self, exc: BaseException) -> str:
        """Stop serving: the state file refused a write, so memory would run ahead of it. Returns the reason."""
        self.failure = f"the state file {self.settings.state} stopped accepting writes ({exc}); restart the server"
        log.critical("%s", self.failure)
        return self.failure

    def _check_healthy(self) -> None:
        if self.failure is not None:
            raise UnavailableError(self.failure)

    def _sample_dict(self, source: str, key: int) -> dict[str, Any]:
        src = self.curriculum.sources[source]
        record = src.record(key)
        return {
            "sample_id": src.sample_id(key),
            "dataset_id": source,
            "system_prompt": record.system_prompt or self.curriculum.system_prompt,
            "prompt": record.prompt,
            "metadata": dict(record.metadata),
        }

    def _gate_view(self, stage: int) -> tuple[float | None, int]:
        stats = self._stats[stage]
        return stats.rolling, len(stats.window)

    def _cache_get(self, iteration: int) -> _Batch | None:
        batch = self._cache.get(iteration)
        if batch is not None:
            self._cache.move_to_end(iteration)
        return batch

    def _cache_put(self, batch: _Batch) -> None:
        s = self.settings
        if s.sample_cache == 0 or batch.iteration in self._cache:
            return
        self._cache[batch.iteration] = batch
        self._cache_bytes += batch.size
        # Bounded in count and in bytes: a batch of long prompts may be megabytes.
        while self._cache and (len(self._cache) > s.sample_cache or self._cache_bytes > s.sample_cache_bytes):
            self._cache_bytes -= self._cache.popitem(last=False)[1].size

    # --- grade ------------------------------------------------------------------------------------------

    async def grade(self, req: wire.GradeRequest) -> wire.GradeResponse:
        """Rewards for the request's completions, matched by ``(sample_id, completion_index)``."""
        self._check_healthy()
        items = await self._validate_items(req)
        if req.iteration is not None and any(it.slot is not None for it in items):
            await self._check_slots(items, req.iteration)
        await self._attribute(items, req.iteration)

        keys = [it.key for it in items if it.record is not None]
        # Only an iteration that was graded before can have stored grades: usually there is nothing to look up.
        graded = {i for i in {key[0] for key in keys} if await self._quick(self.store.has_grades, i)}
        stored = await self._quick(self.store.find_grades, [k for k in keys if k[0] in graded]) if graded else {}
        fresh: list[_Item] = []
        for it in items:
            if it.record is None:
                continue
            prior = stored.get(it.key)
            # Errors are not final: a completion whose grader failed is graded again when posted again.
            if prior is None or prior.error is not None:
                fresh.append(it)
        if fresh:
            await self._run_graders(fresh)
        rows = {it.key: self._to_row(it) async for it in _paced(fresh)}
        raced: set[GradeKey] = set()
        # Stored (and counted) a slice at a time; each grade is idempotent, so a slice is a unit of its own.
        pending = list(rows.values())
        for start in range(0, len(pending), _GRADES_PER_COMMIT):
            part = pending[start : start + _GRADES_PER_COMMIT]
            outcome = await self._store_grades(part)
            raced.update(row.key for row, status in zip(part, outcome, strict=True) if status == "exists")
            self._count(
                [
                    (row, status == "replaced_error")
                    for row, status in zip(part, outcome, strict=True)
                    if status != "exists"
                ]
            )
            await asyncio.sleep(0)
        if raced:
            # Another request stored the same grade meanwhile; answer with that one, count it once.
            stored.update(await self._quick(self.store.find_grades, raced))
        results = []
        async for it in _paced(items):
            if it.record is None:
                results.append(self._stale_result(it))
                continue
            if it.key in rows and it.key not in raced:
                results.append(self._result(it, rows[it.key], cached=False))
            else:
                self.metrics.grades_cached.inc()
                results.append(self._result(it, stored[it.key], cached=True))
        return wire.GradeResponse(results=results)

    async def _store_grades(self, rows: Sequence[GradeRow]) -> list[GradeOutcome]:
        try:
            return await self._quick(self.store.insert_grades, rows)
        except Exception as exc:
            raise UnavailableError(self._fail(exc)) from exc

    async def _validate_items(self, req: wire.GradeRequest) -> list[_Item]:
        s = self.settings
        if len(req.items) > s.max_grade_items:
            raise InvalidRequestError(
                "items",
                f"{len(req.items)} items is above this server's maximum of {s.max_grade_items} per request "
                "(PROCTOR_MAX_GRADE_ITEMS); split the request",
            )
        # A prompt is its slot when the client names one, else its sample_id.
        next_index: dict[str | int, int] = {}
        seen: dict[tuple[str | int, int], int] = {}
        items: list[_Item] = []
        async for n, item in _paced(enumerate(req.items)):
            if len(item.completion) > s.max_completion_chars:
                raise InvalidRequestError(
                    f"items[{n}].completion",
                    f"{len(item.completion)} characters is above this server's maximum of "
                    f"{s.max_completion_chars} (PROCTOR_MAX_COMPLETION_CHARS)",
                )
            sid = SampleId.parse(item.sample_id)  # its shape was checked with the wire model
            src = self.curriculum.sources.get(sid.source)
            if src is None:
                known = ", ".join(sorted(self.curriculum.sources))
                raise InvalidRequestError(
                    f"items[{n}].sample_id",
                    f"unknown source {sid.source!r} in {item.sample_id!r}; this server's sources are: {known}",
                )
            record = None
            if sid.version == src.version:
                try:
                    record = src.record(sid.key)
                except KeyError:
                    raise InvalidRequestError(
                        f"items[{n}].sample_id",
                        f"source {sid.source!r} has no record {sid.key} (it has {src.size}); "
                        "send sample ids exactly as /sample returned them",
                    ) from None
            prompt: str | int = item.sample_id if item.slot is None else item.slot
            index = item.completion_index
            if index is None:
                index = next_index.get(prompt, 0)
            next_index[prompt] = max(next_index.get(prompt, 0), index + 1)
            pair = (prompt, index)
            if pair in seen:
                named = f"(sample_id, completion_index) = ({item.sample_id!r}, {index})"
                if item.slot is not None:
                    named = f"(slot, completion_index) = ({item.slot}, {index})"
                raise InvalidRequestError(
                    f"items[{n}]",
                    f"{named} already appears at items[{seen[pair]}]; give each completion of a prompt its own "
                    "completion_index (and a record served in two slots, each its slot)",
                )
            seen[pair] = n
            items.append(
                _Item(item.sample_id, item.slot, index, item.completion, item.completion_tokens, sid.source, record)
            )
        return items

    async def _check_slots(self, items: Sequence[_Item], iteration: int) -> None:
        """Each item's slot must hold its sample_id in the iteration's batch, so that a grade keyed by slot
        is the grade of the prompt the client was served there."""
        ids = await self._sample_ids(iteration)
        if ids is None:
            raise InvalidRequestError(
                "iteration",
                f"iteration {iteration} was never sampled by this server, so its slots are unknown; send the "
                "iteration /sample served, or items without slot",
            )
        for n, it in enumerate(items):
            if it.slot is None:
                continue
            if it.slot >= len(ids):
                raise InvalidRequestError(
                    f"items[{n}].slot", f"iteration {iteration} has {len(ids)} slots (0..{len(ids) - 1}), not {it.slot}"
                )
            if ids[it.slot] != it.sample_id:
                raise InvalidRequestError(
                    f"items[{n}].slot",
                    f"slot {it.slot} of iteration {iteration} holds {ids[it.slot]!r}, not {it.sample_id!r}; send "
                    "each sample's slot exactly as /sample returned it",
                )

    async def _sample_ids(self, iteration: int) -> tuple[str, ...] | None:
        batch = self._pending[iteration][0] if iteration in self._pending else await self._stored_batch(iteration)
        return None if batch is None else batch.sample_ids

    async def _attribute(self, items: Sequence[_Item], iteration: int | None) -> None:
        """Give each item the iteration (and so the stage) it belongs to, and its idempotency key."""
        served: dict[str, int] = {}
        if iteration is None:
            served = await self._quick(self.store.latest_served, [it.sample_id for it in items])
        async for it in _paced(items):
            # Ids that were never served (sampled by another server, say) count toward the latest iteration.
            it_iter = iteration if iteration is not None else served.get(it.sample_id, self.last_iteration or 0)
            it.stage = self.schedule.stage_of(it_iter)
            sha = hashlib.sha256(it.completion.encode()).hexdigest()
            it.key = (it_iter, it.sample_id, NO_SLOT if it.slot is None else it.slot, it.completion_index, sha)

    async def _run_graders(self, items: Sequence[_Item]) -> None:
        tasks: list[asyncio.Future[None]] = [asyncio.ensure_future(self._grade_local(items))]
        by_source: dict[str, list[_Item]] = {}
        for it in items:
            by_source.setdefault(it.source, []).append(it)
        for source, group in by_source.items():
            for grader in self.curriculum.graders[source].remote:
                tasks.append(asyncio.ensure_future(self._grade_remote_group(grader, group)))
        await asyncio.gather(*tasks)

    def _grade_input(self, it: _Item) -> GradeInput:
        assert it.record is not None
        return GradeInput(
            prompt=it.record.prompt,
            completion=it.completion,
            answer=it.record.answer,
            metadata=it.record.metadata,
            completion_tokens=it.completion_tokens,
        )

    async def _grade_local(self, items: Sequence[_Item]) -> None:
        local = [it for it in items if self.curriculum.graders[it.source].local]
        if not local:
            return
        tasks = [(self.curriculum.graders[it.source].local, self._grade_input(it)) for it in local]
        started = time.perf_counter()
        outcomes = await self.pool.run_many(tasks, self.settings.grader_timeout_s)
        self.metrics.grader_seconds.observe(time.perf_counter() - started)
        for it, (graders, _), outcome in zip(local, tasks, outcomes, strict=True):
            if isinstance(outcome, GraderPoolError):
                kind = "timeout" if isinstance(outcome, GraderTimeout) else "crash"
                names = "+".join(g.key for g in graders)
                it.errors.append(f"{names}: {outcome}")
                self.metrics.grader_errors.labels(names, kind).inc()
                continue
            for key, value in outcome.items():
                if isinstance(value, str):
                    it.errors.append(f"{key}: {value}")
                    self.metrics.grader_errors.labels(key, "error").inc()
                else:
                    it.scores[key] = value

    async def _grade_remote_group(self, grader: RemoteGrader, group: Sequence[_Item]) -> None:
        results = await grade_remote(self.http, grader, [self._grade_input(it) for it in group])
        for it, value in zip(group, results, strict=True):
            if isinstance(value, RemoteFailure):
                it.errors.append(value)
                self.metrics.grader_errors.labels(grader.key, "timeout" if value.timeout else "error").inc()
            else:
                it.scores[grader.key] = value

    def _to_row(self, it: _Item) -> GradeRow:
        graders: SourceGraders = self.curriculum.graders[it.source]
        if it.errors:
            return GradeRow(it.key, it.stage, it.source, graders.on_error, dict(it.scores), "; ".join(it.errors))
        return GradeRow(it.key, it.stage, it.source, graders.compose(it.scores), dict(it.scores), None)

    def _count(self, counted: Sequence[tuple[GradeRow, bool]]) -> None:
        """Fold newly stored grades (with whether each replaced a stored error) into the statistics."""
        per_source: Counter[tuple[int, str]] = Counter()
        for row, replaced_error in counted:
            stats = self._stats[row.stage]
            if replaced_error:
                stats.errors -= 1
            if row.error is not None:
                stats.errors += 1
                continue
            stats.graded += 1
            stats.reward_sum += row.reward
            stats.window.append(row.reward)
            per_source[row.stage, row.source] += 1
            self.metrics.reward.labels(self.curriculum.stages[row.stage].name).observe(row.reward)
        for (stage, source), n in per_source.items():
            self.metrics.grades.labels(self.curriculum.stages[stage].name, source).inc(n)
        for stage in {stage for stage, _ in per_source}:
            rolling = self._stats[stage].rolling
            if rolling is not None:
                self.metrics.rolling_reward.labels(self.curriculum.stages[stage].name).set(rolling)

    def _result(self, it: _Item, row: GradeRow, *, cached: bool) -> wire.GradeResult:
        return wire.GradeResult(
            sample_id=it.sample_id,
            slot=it.slot,
            completion_index=it.completion_index,
            reward=row.reward,
            components=row.components,
            error=row.error,
            cached=cached,
        )

    def _stale_result(self, it: _Item) -> wire.GradeResult:
        sid = SampleId.parse(it.sample_id)
        src = self.curriculum.sources[sid.source]
        self.metrics.grader_errors.labels("-", "stale").inc()
        return wire.GradeResult(
            sample_id=it.sample_id,
            slot=it.slot,
            completion_index=it.completion_index,
            reward=self.curriculum.graders[sid.source].on_error,
            error=(
                f"stale sample_id: it was served from version {sid.version} of source {sid.source!r}, which is now "
                f"version {src.version} (its data or settings changed), so it was not graded"
            ),
        )

    # --- read-only views --------------------------------------------------------------------------------

    def meta(self) -> wire.Meta:
        c = self.curriculum
        return wire.Meta(
            total_iterations=c.total_iterations,
            stages=[wire.StageInfo(name=s.name, until_step=s.until_step) for s in c.stages],
            curriculum=c.name,
            curriculum_hash=c.hash,
            seed=c.seed,
            sources=[
                wire.SourceInfo(
                    name=name,
                    kind=src.kind,
                    version=src.version,
                    size=src.size,
                    graders=list(c.graders[name].names),
                )
                for name, src in c.sources.items()
            ],
            max_batch_size=self.settings.max_batch_size,
            max_grade_items=self.settings.max_grade_items,
            max_body_bytes=self.settings.max_body_bytes,
            version=__version__,
        )

    def curriculum_state(self) -> wire.CurriculumState:
        c = self.curriculum
        starts: dict[int, int] = {0: 0}
        for t in self.schedule.transitions:
            starts[t.to_stage] = t.iteration
        current = self.schedule.current
        stages = []
        for s, stats in zip(c.stages, self._stats, strict=True):
            stages.append(
                wire.StageState(
                    name=s.name,
                    index=s.index,
                    until_step=s.until_step,
                    started_at=starts.get(s.index) if s.index <= current else None,
                    advance=s.advance.model_dump() if s.advance else None,
                    iterations=stats.iterations,
                    samples=stats.samples,
                    graded=stats.graded,
                    errors=stats.errors,
                    mean_reward=stats.reward_sum / stats.graded if stats.graded else None,
                    rolling_reward=stats.rolling,
                    rolling_count=len(stats.window),
                )
            )
        return wire.CurriculumState(
            curriculum=c.name,
            curriculum_hash=c.hash,
            current_stage=c.stages[current].name,
            current_stage_index=current,
            last_iteration=self.last_iteration,
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
                for t in self.schedule.transitions
            ],
            stages=stages,
        )

    def _publish_stage_metrics(self) -> None:
        current = self.schedule.current
        self.metrics.current_stage.set(current)
        for s in self.curriculum.stages:
            self.metrics.stage_active.labels(s.name).set(1 if s.index == current else 0)
