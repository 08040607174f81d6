"""The grading service: ``POST /grade``, rewards for completions, each graded once.

A request's items are validated, placed in their slots of the request's iteration (sent, or inferred from the
record), given the iteration (and so the stage) they belong to and an idempotency key, and looked up among the
stored grades. What is new goes to the experience store, each completion to its row (its step's slot, or the
step's loose completions), graded by the grader role: this request itself, on this server's graders, before
anything is written (then the completions, their rewards and their grades are one transaction); or remote
``proctor grade-worker`` processes (``PROCTOR_GRADER_WORKERS=0``), for which the completions are written and
waited for. Grades are stored (with the rewards, in one transaction) before they are answered or counted in
the curriculum's statistics; posting a completion again returns its stored grade.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from proctor.experience import RowKey, Value
from proctor.experience import columns as col
from proctor.server.curriculum.loader import Curriculum
from proctor.server.exceptions import InvalidRequestError
from proctor.server.grading.fanout import GraderFanout
from proctor.server.metrics import Metrics
from proctor.server.pacing import paced
from proctor.server.services.grade_rows import grade_rows
from proctor.server.services.grader_role import LEASE_S, grading_time
from proctor.server.services.placement import Completion, Graded, reference
from proctor.server.services.recording import grade_key
from proctor.server.services.rollouts import Written
from proctor.server.settings import Settings
from proctor.server.sources.base import Record, SampleId
from proctor.server.state.rows import NO_SLOT, GradeKey, GradeRow
from proctor.wire import dataserver as wire

__all__ = ["GradeLookups", "GradedSteps", "GradingContext", "GradingService"]

log = logging.getLogger("proctor.grading")

_Row = tuple[int, int, int]
"""Where the store holds a completion: ``(table, slot, index)``."""


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
    position: int = 0
    row: _Row = (0, 0, 0)
    """Where the store holds it: ``(table, slot, index)``."""


class GradeLookups(Protocol):
    """What ``/grade`` reads of the run's stored grades (:class:`~proctor.server.storage.AsyncStore`)."""

    def check_healthy(self) -> None: ...

    async def graded_iterations(self, iterations: Iterable[int]) -> set[int]: ...

    async def find_grades(self, keys: Iterable[GradeKey]) -> dict[GradeKey, GradeRow]: ...

    async def latest_served(self, sample_ids: Iterable[str]) -> dict[str, int]: ...


class GradedSteps(Protocol):
    """The served steps ``/grade`` places completions in, and the experience store that keeps them: this
    server's (:class:`~proctor.server.services.rollouts.Rollouts`), or for a standby the serving server's
    (:class:`~proctor.server.services.standby_grading.ServingSteps`)."""

    @property
    def last_iteration(self) -> int | None: ...

    def stage_of(self, iteration: int) -> int: ...

    async def sample_ids(self, iteration: int) -> Sequence[str] | None: ...

    async def write_graded(self, graded: Sequence[Graded], *, lease_s: float) -> Written: ...

    async def enqueue(self, completions: Sequence[Completion]) -> list[tuple[int, int, int]]: ...

    async def rewards(
        self, table: int, rows: Sequence[RowKey], timeout_s: float, *, written_now: bool = False
    ) -> dict[str, list[Value]]: ...


@dataclass(frozen=True, slots=True)
class GradingContext:
    """What a grading service works with: the curriculum, the settings and metrics, the stored grades, and
    the steps its completions go to."""

    curriculum: Curriculum
    settings: Settings
    metrics: Metrics
    storage: GradeLookups
    steps: GradedSteps


class GradingService:
    def __init__(self, ctx: GradingContext, fanout: GraderFanout | None) -> None:
        self.ctx = ctx
        self.fanout = fanout
        self.steps = ctx.steps
        self._loop_share = asyncio.Lock()

    async def grade(self, req: wire.GradeRequest) -> wire.GradeResponse:
        """Rewards for the request's completions, matched by ``(slot or sample_id, completion_index)``."""
        self.ctx.storage.check_healthy()
        # The event loop's share of a /grade (validation, look-ups, composing, storing, answering) runs one
        # request at a time, in slices: with eight requests interleaving their slices, a /healthz or /sample
        # waited for all eight at each of its turns of the loop. Grading itself, in other processes or
        # remote, runs outside the gate, side by side.
        async with self._loop_share:
            items = await self._validate(req)
            if req.iteration is not None:
                await self._place(items, req.iteration)
            await self._attribute(items, req.iteration)
            keys = [it.key for it in items if it.record is not None]
            # Only an iteration that was graded before can have stored grades: usually nothing to look up.
            graded = await self.ctx.storage.graded_iterations({key[0] for key in keys})
            stored = await self.ctx.storage.find_grades([k for k in keys if k[0] in graded]) if graded else {}
            # Errors are not final: a completion whose grader failed is graded again (in a row of its own).
            fresh = [
                it
                for it in items
                if it.record is not None and ((prior := stored.get(it.key)) is None or prior.error is not None)
            ]
        # The store's work (on its thread) and grading (in other processes, or remote) run outside the loop
        # share: a request waiting for them holds up no other.
        completions = self._completions(fresh, {it.key for it in fresh if it.key in stored})
        values: dict[_Row, GradeRow] = {}
        raced: set[GradeKey] = set()
        if self.fanout is not None:
            values, raced = await self._grade_and_write(fresh, completions, self.fanout)
        elif completions:
            for it, row in zip(fresh, await self.steps.enqueue(completions), strict=True):
                it.row = row
        waiting = [it for it in fresh if it.row not in values]
        # Rows this request wrote for the role elsewhere are graded by collections to come; those its own write
        # left to another holder of the role may be graded already.
        values.update(await self._wait(waiting, written_now=self.fanout is None))
        async with self._loop_share:
            return await self._answer(items, fresh, values, stored, raced)

    def _completions(self, fresh: Sequence[_Item], regrade: set[GradeKey]) -> list[Completion]:
        """What the store is given of each fresh item: its step and slot, its record, its completion."""
        completions = []
        for it in fresh:
            assert it.record is not None
            completions.append(
                Completion(
                    it.key[0],
                    it.slot,
                    it.sample_id,
                    it.completion_index,
                    it.completion,
                    it.completion_tokens,
                    it.record,
                    position=it.position,
                    regrade=it.key in regrade,
                )
            )
        return completions

    async def _grade_and_write(
        self, fresh: Sequence[_Item], completions: Sequence[Completion], fanout: GraderFanout
    ) -> tuple[dict[_Row, GradeRow], set[GradeKey]]:
        """Grade the completions as the grader role, on this server's graders, then write them to the store with
        their rewards and grades: one store call and one transaction, so that nothing of a request the store
        refuses is kept, and no other holder of the role takes rows graded here. Returns the rewards of the
        rows this request collected, and the keys whose grade a concurrent request stored first."""
        if not fresh:
            return {}, set()
        records = [it.record for it in fresh if it.record is not None]
        assert len(records) == len(fresh)  # only current records are fresh
        needs: dict[str, list[Value]] = {
            col.SAMPLE_ID: [it.sample_id for it in fresh],
            col.PROMPT: [r.prompt for r in records],
            col.REFERENCE: [reference(r) for r in records],
            col.COMPLETION: [it.completion for it in fresh],
            col.COMPLETION_TOKENS: [it.completion_tokens for it in fresh],
        }
        columns = await grade_rows(fanout, self.ctx.curriculum.graders, needs)
        graded: list[Graded] = []
        for it, c, reward, detail in zip(
            fresh, completions, columns[col.REWARD], columns[col.REWARD_DETAIL], strict=True
        ):
            grade = GradeRow(it.key, it.stage, it.source, float(reward), *col.parse_reward_detail(detail))
            graded.append(Graded(c, grade.reward, detail, grade))
        written = await self.steps.write_graded(graded, lease_s=LEASE_S)
        found: dict[_Row, GradeRow] = {}
        for it, row, g in zip(fresh, written.rows, graded, strict=True):
            it.row = row
            if row in written.collected:
                found[row] = g.grade
        return found, written.raced

    async def _wait(self, waiting: Sequence[_Item], *, written_now: bool) -> dict[_Row, GradeRow]:
        """The rewards of rows another holder of the grader role grades (a remote grade-worker, or this
        server's role that took them first), or graded already."""
        by_table: dict[int, list[_Item]] = {}
        for it in waiting:
            by_table.setdefault(it.row[0], []).append(it)
        s = self.ctx.settings
        out: dict[_Row, GradeRow] = {}

        async def one(table: int, its: list[_Item]) -> None:
            timeout = grading_time(len(its), max(s.grader_workers, 1), s.grader_timeout_s)
            rows = [it.row[1:] for it in its]
            values = await self.steps.rewards(table, rows, timeout, written_now=written_now)
            for n, it in enumerate(its):
                reward = float(values[col.REWARD][n])
                detail = col.parse_reward_detail(values[col.REWARD_DETAIL][n])
                out[it.row] = GradeRow(it.key, it.stage, it.source, reward, *detail)

        await asyncio.gather(*(one(table, its) for table, its in by_table.items()))
        return out

    async def _answer(
        self,
        items: Sequence[_Item],
        fresh: Sequence[_Item],
        values: Mapping[_Row, GradeRow],
        stored: dict[GradeKey, GradeRow],
        raced: set[GradeKey],
    ) -> wire.GradeResponse:
        """The results. Every fresh grade is stored by now, by its collector: this request's, or (for rows it
        waited for) another holder's of the grader role, or for a server killed in between, the next start's
        recovery."""
        ctx = self.ctx
        rows = {it.key: values[it.row] for it in fresh}
        if raced:
            # Another request stored the same grade meanwhile; answer with that one, counted once.
            stored.update(await ctx.storage.find_grades(raced))
        results = []
        async for it in paced(items):
            if it.record is None:
                results.append(self._stale_result(it))
            elif it.key in rows and it.key not in raced:
                results.append(_result(it, rows[it.key], cached=False, table=it.row[0]))
            else:
                ctx.metrics.grades_cached.inc()
                results.append(_result(it, stored[it.key], cached=True, table=None))
        return wire.GradeResponse(results=results)

    async def _validate(self, req: wire.GradeRequest) -> list[_Item]:
        s = self.ctx.settings
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
        async for n, item in paced(enumerate(req.items)):
            if len(item.completion) > s.max_completion_chars:
                raise InvalidRequestError(
                    f"items[{n}].completion",
                    f"{len(item.completion)} characters is above this server's maximum of "
                    f"{s.max_completion_chars} (PROCTOR_MAX_COMPLETION_CHARS)",
                )
            source, record = self._record(n, item.sample_id)
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
                _Item(
                    item.sample_id,
                    item.slot,
                    index,
                    item.completion,
                    item.completion_tokens,
                    source,
                    record,
                    position=n,
                )
            )
        return items

    def _record(self, n: int, sample_id: str) -> tuple[str, Record | None]:
        """The source and record of ``items[n]``'s sample id; no record when the id is stale (its source
        changed)."""
        sid = SampleId.parse(sample_id)  # its shape was checked with the wire model
        src = self.ctx.curriculum.sources.get(sid.source)
        if src is None:
            known = ", ".join(sorted(self.ctx.curriculum.sources))
            raise InvalidRequestError(
                f"items[{n}].sample_id",
                f"unknown source {sid.source!r} in {sample_id!r}; this server's sources are: {known}",
            )
        if sid.version != src.version:
            return sid.source, None
        try:
            return sid.source, src.record(sid.key)
        except KeyError:
            raise InvalidRequestError(
                f"items[{n}].sample_id",
                f"source {sid.source!r} has no record {sid.key} (it has {src.size}); "
                "send sample ids exactly as /sample returned them",
            ) from None

    async def _place(self, items: Sequence[_Item], iteration: int) -> None:
        """Give each item its slot in the iteration's batch. A slot the client sent must hold the item's
        sample_id, so that a grade keyed by slot is the grade of the prompt the client was served there. Without
        one, the slot is the one the record fills; a record that fills several must have its slot sent. An item
        whose record is not in the batch keeps no slot."""
        ids = await self.steps.sample_ids(iteration)
        if ids is None:
            if any(it.slot is not None for it in items):
                raise InvalidRequestError(
                    "iteration",
                    f"iteration {iteration} was never sampled by this server, so its slots are unknown; send the "
                    "iteration /sample served, or items without slot",
                )
            return
        slots_of = _slots_of(ids)
        placed: dict[tuple[int, int], int] = {}
        async for n, it in paced(enumerate(items)):
            if it.slot is None:
                held = slots_of.get(it.sample_id, ())
                if len(held) > 1:
                    raise InvalidRequestError(
                        f"items[{n}].slot",
                        f"{it.sample_id!r} fills slots {', '.join(map(str, held))} of iteration {iteration}, each a "
                        "prompt of its own: send each item's slot as /sample returned it",
                    )
                if held:
                    it.slot = held[0]
            elif it.slot >= len(ids):
                raise InvalidRequestError(
                    f"items[{n}].slot", f"iteration {iteration} has {len(ids)} slots (0..{len(ids) - 1}), not {it.slot}"
                )
            elif ids[it.slot] != it.sample_id:
                raise InvalidRequestError(
                    f"items[{n}].slot",
                    f"slot {it.slot} of iteration {iteration} holds {ids[it.slot]!r}, not {it.sample_id!r}; send "
                    "each sample's slot exactly as /sample returned it",
                )
            if it.slot is not None:
                # An inferred slot may meet one the client sent for the same completion.
                pair = (it.slot, it.completion_index)
                if pair in placed:
                    raise InvalidRequestError(
                        f"items[{n}]",
                        f"(slot, completion_index) = {pair} already appears at items[{placed[pair]}]; give each "
                        "completion of a prompt its own completion_index",
                    )
                placed[pair] = n

    async def _attribute(self, items: Sequence[_Item], iteration: int | None) -> None:
        """Give each item the iteration (and so the stage) it belongs to, and its idempotency key."""
        served: dict[str, int] = {}
        if iteration is None:
            served = await self.ctx.storage.latest_served([it.sample_id for it in items])
        latest = self.steps.last_iteration or 0
        async for it in paced(items):
            # Ids that were never served (sampled by another server, say) count toward the latest iteration.
            it_iter = iteration if iteration is not None else served.get(it.sample_id, latest)
            it.stage = self.steps.stage_of(it_iter)
            it.key = grade_key(it_iter, it.sample_id, it.slot, it.completion_index, it.completion)
        if iteration is None:
            await self._place_served(items)

    async def _place_served(self, items: Sequence[_Item]) -> None:
        """Items sent without an iteration belong to the latest step that served their record: each takes the
        slot its record fills there, when it fills one only (else it stays a loose completion of the step)."""
        steps = sorted({it.key[0] for it in items if it.record is not None})
        for step in steps:
            ids = await self.steps.sample_ids(step)
            if ids is None:
                continue
            slots_of = _slots_of(ids)
            async for it in paced([it for it in items if it.key[0] == step and it.record is not None]):
                held = slots_of.get(it.sample_id, [])
                if len(held) == 1:
                    it.slot = held[0]
                    it.key = grade_key(step, it.sample_id, it.slot, it.completion_index, it.completion)

    def _stale_result(self, it: _Item) -> wire.GradeResult:
        sid = SampleId.parse(it.sample_id)
        src = self.ctx.curriculum.sources[sid.source]
        self.ctx.metrics.grader_errors.labels("-", "stale").inc()
        return wire.GradeResult(
            sample_id=it.sample_id,
            slot=it.slot,
            completion_index=it.completion_index,
            reward=self.ctx.curriculum.graders[sid.source].on_error,
            error=(
                f"stale sample_id: it was served from version {sid.version} of source {sid.source!r}, which is now "
                f"version {src.version} (its data or settings changed), so it was not graded"
            ),
        )


def _slots_of(sample_ids: Sequence[str]) -> dict[str, list[int]]:
    """The slots each sample id fills in a batch."""
    slots: dict[str, list[int]] = {}
    for slot, sample_id in enumerate(sample_ids):
        slots.setdefault(sample_id, []).append(slot)
    return slots


def _result(it: _Item, row: GradeRow, *, cached: bool, table: int | None) -> wire.GradeResult:
    return wire.GradeResult(
        sample_id=it.sample_id,
        slot=it.slot,
        completion_index=it.completion_index,
        reward=row.reward,
        components=row.components,
        error=row.error,
        details=row.details,
        cached=cached,
        table=table,
    )
