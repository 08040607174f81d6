"""Regrading what the experience store kept: the completions already graded, graded again with the curriculum's
graders as they are now (or one of them), their scores written beside the old ones (``proctor regrade``).

A regrade is a consumer of the store, ``regrade.<version>``, whose rows are the graded completions and which
produces ``reward.<version>`` and ``reward_detail.<version>``: the version is a digest of the graders it runs,
so that a regrade with other graders writes other columns, and nothing is ever written over. The store keeps
what the consumer has collected and leases the rest, so a regrade stopped in any way (``kill -9`` included)
goes on where it stopped when started again with the same graders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from pydantic import SecretStr

from proctor.experience import Consumer, Consumption, LeaseError, RowKey, TableInfo, Value
from proctor.experience import columns as col
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import SourceGraders
from proctor.server.metrics import Metrics
from proctor.server.services.grade_rows import grade_rows
from proctor.server.services.grader_role import LEASE_S, ROWS_PER_DISPATCH, renewing
from proctor.server.sources.base import content_version

__all__ = [
    "Regrade",
    "RegradeStats",
    "RegradeStore",
    "grader_version",
    "only_grader",
    "regrade_consumer",
    "verdict_changes",
]

log = logging.getLogger("proctor.regrade")

_HELD_LOOK_S = 1.0  # how often a table whose rows another lease holds is looked at again
_ROWS_PER_READ = 1024


class RegradeStore(Protocol):
    """What a regrade needs of the experience store (its HTTP client or the store itself)."""

    def tables(self) -> list[TableInfo]: ...

    def register(
        self, name: str, *, needs: Sequence[str], produces: Sequence[str] = (), dispatch_size: int | None = None
    ) -> Consumer: ...

    def dispatch(
        self, name: str, count: int | None = None, *, iteration: int | None = None, lease_s: float = 60.0
    ) -> Any: ...

    def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Any: ...

    def renew(self, lease: str, lease_s: float = 60.0) -> float: ...

    def consumption(self, consumer: str, iteration: int) -> Consumption: ...

    def read(
        self, iteration: int, rows: Sequence[RowKey], columns: Sequence[str], *, missing: Literal["error", "none"] = ...
    ) -> dict[str, list[Value]]: ...


def grader_version(graders: Mapping[str, SourceGraders]) -> str:
    """A digest of every source's graders (their references, parameters, weights, remote URLs, ``on_error``):
    what a score depends on besides the completion and its record."""
    return content_version({name: _digested(g) for name, g in sorted(graders.items())})


def _digested(graders: SourceGraders) -> dict[str, Any]:
    fields = dataclasses.asdict(graders)
    if not fields["judges"]:
        del fields["judges"]  # graders without a judge keep the version they had before judges were
    return fields


def only_grader(graders: Mapping[str, SourceGraders], key: str) -> dict[str, SourceGraders]:
    """The graders of the sources that use grader ``key``, reduced to it (its score is then the reward)."""
    out: dict[str, SourceGraders] = {}
    for name, g in graders.items():
        local = tuple(dataclasses.replace(x, weight=1.0, multiplicative=False) for x in g.local if x.key == key)
        remote = tuple(dataclasses.replace(x, weight=1.0, multiplicative=False) for x in g.remote if x.key == key)
        judges = tuple(dataclasses.replace(x, weight=1.0, multiplicative=False) for x in g.judges if x.key == key)
        if local or remote or judges:
            out[name] = SourceGraders(local=local, remote=remote, on_error=g.on_error, names=(key,), judges=judges)
    if not out:
        known = sorted({k for g in graders.values() for k in g.names})
        raise ValueError(f"no source of the curriculum uses grader {key!r}; its graders are: {', '.join(known)}")
    return out


def regrade_consumer(version: str) -> Consumer:
    """The store's consumer of a regrade with graders of ``version``: it reads the graded completions."""
    return Consumer(
        f"regrade.{version}",
        needs=(col.SAMPLE_ID, col.PROMPT, col.REFERENCE, col.COMPLETION, col.COMPLETION_TOKENS, col.REWARD),
        produces=(f"{col.REWARD}.{version}", f"{col.REWARD_DETAIL}.{version}"),
    )


@dataclass
class RegradeStats:
    """Rows regraded here, and results the store refused (their lease had ended: another regrade has them)."""

    regraded: int = 0
    refused: int = 0


class Regrade:
    """``await regrade.run(tables)`` regrades every graded completion of ``tables`` not regraded yet."""

    def __init__(
        self,
        experience: RegradeStore,
        graders: Mapping[str, SourceGraders],
        pool: GraderPool,
        http: httpx.AsyncClient,
        *,
        timeout_s: float,
        rows_per_dispatch: int = ROWS_PER_DISPATCH,
        lease_s: float = LEASE_S,
        judge_api_key: SecretStr | None = None,
    ) -> None:
        self.experience = experience
        self.graders = graders
        self.version = grader_version(graders)
        self.consumer = regrade_consumer(self.version)
        self.fanout = GraderFanout(pool, http, Metrics(), timeout_s, judge_api_key=judge_api_key)
        self.rows_per_dispatch = rows_per_dispatch
        self.lease_s = lease_s
        self.stats = RegradeStats()

    async def run(self, tables: Sequence[int], stop: asyncio.Event | None = None) -> RegradeStats:
        try:
            return await self._regrade(tables, stop or asyncio.Event())
        finally:
            await self.fanout.aclose()  # the judges' connections

    async def _regrade(self, tables: Sequence[int], stop: asyncio.Event) -> RegradeStats:
        c = self.consumer
        await asyncio.to_thread(self.experience.register, c.name, needs=c.needs, produces=c.produces)
        for table in tables:
            while not stop.is_set():
                batch = await asyncio.to_thread(
                    self.experience.dispatch, c.name, self.rows_per_dispatch, iteration=table, lease_s=self.lease_s
                )
                if batch.lease is None:
                    status = await asyncio.to_thread(self.experience.consumption, c.name, table)
                    if status.held == 0 and status.ready == 0:
                        break  # every graded completion of the table is regraded
                    await asyncio.sleep(_HELD_LOOK_S)  # a stopped regrade's lease, until it ends
                    continue
                async with renewing(self._renew, batch.lease, self.lease_s):
                    graded = await grade_rows(self.fanout, self.graders, batch.columns)
                columns = {c.produces[0]: graded[col.REWARD], c.produces[1]: graded[col.REWARD_DETAIL]}
                try:
                    await asyncio.to_thread(self.experience.collect, batch.lease, columns)
                except LeaseError as exc:
                    self.stats.refused += 1
                    log.warning("dropped %d regraded rows: %s", len(batch), exc)
                    continue
                self.stats.regraded += len(batch)
        return self.stats

    async def _renew(self, lease: str, lease_s: float) -> float:
        return await asyncio.to_thread(self.experience.renew, lease, lease_s)


def verdict_changes(experience: RegradeStore, tables: Sequence[int], version: str) -> dict[str, tuple[int, int, int]]:
    """Per source, over the graded completions of ``tables``: how many were regraded, how many of those got
    another reward, and how many the regrade could not grade (its graders failed or do not grade the source)."""
    new, detail = f"{col.REWARD}.{version}", f"{col.REWARD_DETAIL}.{version}"
    names = (col.SAMPLE_ID, col.REWARD, new, detail)
    out: dict[str, list[int]] = {}
    known = {t.iteration: t for t in experience.tables()}
    for table in tables:
        info = known.get(table)
        if info is None or new not in info.written:
            continue
        keys: list[RowKey] = [(s, k) for s in range(info.slots) for k in range(info.group_size or info.width)]
        for start in range(0, len(keys), _ROWS_PER_READ):
            values = experience.read(table, keys[start : start + _ROWS_PER_READ], names, missing="none")
            for sample_id, old, now, cell in zip(*(values[n] for n in names), strict=True):
                if now is None or old is None:
                    continue
                counts = out.setdefault(str(sample_id).split(":", 1)[0], [0, 0, 0])
                counts[0] += 1
                if col.parse_reward_detail(cell).error is not None:
                    counts[2] += 1
                elif abs(float(old) - float(now)) > 1e-9:
                    counts[1] += 1
    return {source: (n[0], n[1], n[2]) for source, n in sorted(out.items())}
