"""The refill service: ``POST /refill``, which groups of a graded step a trainer replaces, round by round, and
the prompts that replace them.

A round is decided once, from the grades the store holds, and recorded before it is answered, so that every
rank, retry and restart gets the same answer. Round 1 looks at every group of the step; each later round at the
groups the round before put in. A replacement is a record of the replaced group's source
(:func:`~proctor.server.curriculum.refill.replacement_key`), in a new slot past the step's batch: ``/grade``
takes its completions there (the step's table keeps its loose completions). The replaced group keeps its rows
and grades, which the curriculum's statistics count like any other; its slot in the step's table is marked with
the slot that replaced it (``replaced_by``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from proctor.server.curriculum.refill import GroupGrades, keeps, replacement_key
from proctor.server.exceptions import ConflictError, InvalidRequestError
from proctor.server.services.batches import ServedBatch
from proctor.server.services.context import ServingContext
from proctor.server.services.rollouts import Rollouts
from proctor.server.sources.base import SampleId
from proctor.server.spec import RefillSpec
from proctor.wire import dataserver as wire

__all__ = ["RefillService"]


class RefillService:
    def __init__(self, ctx: ServingContext, rollouts: Rollouts) -> None:
        self.ctx = ctx
        self.rollouts = rollouts
        self.sampling = rollouts.sampling
        # One round is decided at a time: a round extends its step's batch, which the next round reads.
        self._lock = asyncio.Lock()

    async def refill(self, req: wire.RefillRequest) -> wire.RefillResponse:
        """The answer to ``req``: decided and recorded on its first request, read back on every later one."""
        self.ctx.storage.check_healthy()
        batch = await self.sampling.served(req.iteration)
        if batch is None:
            raise InvalidRequestError(
                "iteration",
                f"iteration {req.iteration} was never sampled by this server; ask /refill for a step that /sample "
                "served and /grade graded",
            )
        stage = self.ctx.curriculum.stages[batch.stage]
        rule = stage.refill
        if rule is None:
            raise InvalidRequestError(
                "round",
                f"iteration {req.iteration} is in stage {stage.name!r}, which replaces no groups (its `refill` is not "
                "set; /sample answered refill_rounds 0 for it)",
            )
        if req.round > rule.max_rounds:
            raise InvalidRequestError(
                "round",
                f"{req.round} is beyond the {rule.max_rounds} refill rounds stage {stage.name!r} allows "
                "(its refill.max_rounds)",
            )
        async with self._lock:
            rounds = await self.ctx.storage.refills(req.iteration)
            # Read again: a round decided while this request waited for the lock extended the batch.
            batch = await self.sampling.served(req.iteration)
            assert batch is not None
            if len(rounds) < req.round - 1:
                raise InvalidRequestError(
                    "round",
                    f"round {req.round} of iteration {req.iteration} comes after round {len(rounds) + 1}, which "
                    "was never asked for; ask for the rounds in order, from 1",
                )
            if len(rounds) >= req.round:
                detail = rounds[req.round - 1][1]
                if detail["group_size"] != req.group_size:
                    raise ConflictError(
                        f"round {req.round} of iteration {req.iteration} was decided with group_size "
                        f"{detail['group_size']}; ask again with that group_size"
                    )
            else:
                detail, batch = await self._decide(batch, rule, req, [d for _, d in rounds])
        return _answer(batch, rule, req.round, detail)

    async def _decide(
        self, batch: ServedBatch, rule: RefillSpec, req: wire.RefillRequest, earlier: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], ServedBatch]:
        """Decide round ``req.round`` (the rounds before it are ``earlier``), record it, and extend the batch."""
        occupant = list(range(batch.batch_size))  # the slot each position of the batch holds now
        looked = list(range(batch.batch_size))  # the positions this round looks at
        for detail in earlier:
            looked = []
            for position, _, slot in detail["replaced"]:
                occupant[position] = slot
                looked.append(position)
        slots = [occupant[p] for p in looked]
        rewards = await self.ctx.storage.slot_rewards(req.iteration, slots)
        if not earlier and not rewards:
            raise InvalidRequestError(
                "iteration",
                f"iteration {req.iteration} has no graded completions; /refill decides from a step's grades, so "
                "grade its completions first",
            )
        for slot in slots:
            graded = len(rewards.get(slot, {}))
            if graded < req.group_size:
                raise ConflictError(
                    f"slot {slot} of iteration {req.iteration} has {graded} of its {req.group_size} "
                    f"completions graded (group_size); ask again once every group round {req.round} looks at is "
                    "graded"
                )
        curriculum = self.ctx.curriculum
        held: dict[str, set[int]] = {}
        for sample_id in batch.sample_ids:
            sid = SampleId.parse(sample_id)
            held.setdefault(sid.source, set()).add(sid.key)
        replaced: list[list[int]] = []
        samples: list[dict[str, Any]] = []
        for position, slot in zip(looked, slots, strict=True):
            if keeps(rule, GroupGrades.of(r for r in rewards[slot].values() if r is not None)):
                continue
            source = SampleId.parse(batch.sample_ids[slot]).source
            size = curriculum.sources[source].size
            key = replacement_key(curriculum.seed, source, size, req.iteration, req.round, position, held[source])
            held[source].add(key)
            replaced.append([position, slot, len(batch.sample_ids) + len(samples)])
            samples.append(self.sampling.sample_dict(source, key))
        detail = {"rule": rule.kind, "group_size": req.group_size, "groups": len(looked), "replaced": replaced}
        extended = batch.extended(samples)
        await self.rollouts.record_refill(
            req.iteration,
            req.round,
            detail,
            extended.samples_json(),
            [s["sample_id"] for s in samples],
            {slot: new for _, slot, new in replaced},
        )
        self.ctx.metrics.refilled_groups.labels(curriculum.stages[batch.stage].name).inc(len(replaced))
        self.ctx.progress.timeline.refilled(req.iteration, len(replaced))
        self.sampling.refilled(extended)
        return detail, extended


def _answer(batch: ServedBatch, rule: RefillSpec, round_: int, detail: dict[str, Any]) -> wire.RefillResponse:
    replacements = [
        wire.Replacement(replaces=slot, sample=wire.Sample.model_validate_json(batch.samples[new]))
        for _, slot, new in sorted(detail["replaced"], key=lambda r: r[1])
    ]
    return wire.RefillResponse(
        iteration=batch.iteration,
        round=round_,
        rule=rule.kind,
        max_rounds=rule.max_rounds,
        groups=detail["groups"],
        replacements=replacements,
    )
