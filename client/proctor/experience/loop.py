"""The worker's loop over either face of the store: ``while not all_consumed``: dispatch, compute, collect."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from proctor.experience.consumers import Collected, Dispatch
from proctor.experience.errors import LeaseError
from proctor.experience.values import Value

__all__ = ["ExperienceLike", "consume"]


class ExperienceLike(Protocol):
    """What both faces of the store offer a worker (``ExperienceStore`` and
    ``proctor.client.experience.ExperienceClient``)."""

    def dispatch(
        self,
        consumer: str,
        count: int | None = None,
        *,
        iteration: int | None = None,
        groups: bool = False,
        dp_size: int = 1,
        balance_by: str | None = None,
        max_tokens_per_microbatch: int | None = None,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> Dispatch: ...

    def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Collected: ...

    def collect_and_dispatch(
        self,
        lease: str,
        columns: Mapping[str, Sequence[Value]],
        count: int | None = None,
        *,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[Collected, Dispatch]: ...

    def dispatch_many(
        self, consumer: str, count: int | None = None, *, tables: int = 8, lease_s: float = 60.0, wait_s: float = 0.0
    ) -> tuple[Dispatch, ...]: ...

    def collect_many(
        self, consumer: str, results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]]
    ) -> tuple[Collected | LeaseError, ...]: ...

    def collect_and_dispatch_many(
        self,
        consumer: str,
        results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]],
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[tuple[Collected | LeaseError, ...], tuple[Dispatch, ...]]: ...

    def renew(self, lease: str, lease_s: float = 60.0) -> float: ...

    def all_consumed(self, consumer: str, iteration: int) -> bool: ...


def consume(
    experience: ExperienceLike,
    consumer: str,
    iteration: int,
    work: Callable[[Dispatch], Mapping[str, Sequence[Value]]],
    *,
    count: int | None = None,
    groups: bool = False,
    lease_s: float = 60.0,
    poll_s: float = 0.05,
    timeout_s: float | None = None,
) -> int:
    """Run ``work`` on every row of ``iteration`` as ``consumer`` until it has consumed them all, collecting
    what ``work`` returns (its columns, one value per dispatched row). Waits ``poll_s`` between empty
    dispatches (rows whose columns are not written yet); raises ``TimeoutError`` after ``timeout_s``.
    Returns the rows this call consumed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done = 0
    while not experience.all_consumed(consumer, iteration):
        batch = experience.dispatch(consumer, count, iteration=iteration, groups=groups, lease_s=lease_s)
        if batch.lease is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"consumer {consumer!r} found no ready row of iteration {iteration} for {timeout_s}s; "
                    "is the producer of its columns running?"
                )
            time.sleep(poll_s)
            continue
        experience.collect(batch.lease, work(batch))
        done += len(batch)
    return done
