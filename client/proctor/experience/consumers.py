"""A consumer (a named role: the columns it needs and those it writes), what a dispatch hands it, what a collection
consumed, where it stands in a table, and how a dispatch's rows are split among data-parallel readers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from proctor.batching.dynamic import plan_dynamic_batches
from proctor.experience.errors import ExperienceInputError
from proctor.experience.tables import RowKey
from proctor.experience.values import Value

__all__ = ["Collected", "Consumer", "Consumption", "Dispatch", "balanced_parts", "even_parts"]


@dataclass(frozen=True, slots=True)
class Consumer:
    """A named role: the columns it needs before a row is handed to it, and the columns it may write back."""

    name: str
    needs: tuple[str, ...]
    produces: tuple[str, ...] = ()
    dispatch_size: int | None = None
    """Rows per ``dispatch`` when the call does not say: for a role of the batch-size vocabulary,
    ``derive_batch_plan(...).dispatch_size(role)`` (``global × n / role_dp_size`` pairs; the whole batch for a
    rule reward and for advantages)."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Rows handed to one consumer under one lease, with the values of the columns it needs.

    Empty (``lease is None``) when no row is ready. ``parts[r]`` lists the positions in ``rows`` that
    data-parallel reader ``r`` takes (one part holding every position without ``dp_size``).
    """

    consumer: str
    iteration: int | None
    lease: str | None
    expires_at: float | None
    rows: tuple[RowKey, ...]
    columns: Mapping[str, list[Value]]
    parts: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True, slots=True)
class Collected:
    """What a ``collect`` consumed: the lease's consumer, table and rows (in dispatch order)."""

    consumer: str
    iteration: int
    rows: tuple[RowKey, ...]


@dataclass(frozen=True, slots=True)
class Consumption:
    """Where one consumer stands in one table."""

    consumer: str
    iteration: int
    rows: int
    consumed: int
    """Rows it collected, and rows whose column it produces was written otherwise (nothing is left for it there)."""
    held: int
    """Rows under a live lease."""
    ready: int
    """Rows it could be handed now."""

    @property
    def all_consumed(self) -> bool:
        return self.consumed == self.rows


def even_parts(n: int, dp_size: int, unit: int) -> tuple[tuple[int, ...], ...]:
    """``n`` positions in ``dp_size`` contiguous parts of near-equal size, cut at multiples of ``unit`` (a
    group stays with one reader)."""
    units = n // unit
    bounds = [round(r * units / dp_size) * unit for r in range(dp_size + 1)]
    return tuple(tuple(range(bounds[r], bounds[r + 1])) for r in range(dp_size))


def balanced_parts(values: Iterable[Value], dp_size: int, max_tokens: int | None) -> tuple[tuple[int, ...], ...]:
    """``values``' positions in ``dp_size`` parts balanced by length (an array's, or an integer), by the
    dynamic-batching planner under ``max_tokens`` per micro-batch when given."""
    lengths = []
    for n, v in enumerate(values):
        length = len(v) if isinstance(v, np.ndarray | list) else v
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ExperienceInputError(
                "balance_by", f"row {n} has {v!r} there: balance by an array column or a positive integer one"
            )
        lengths.append(length)
    try:
        plan = plan_dynamic_batches(
            lengths, max_tokens_per_microbatch=max_tokens or max(sum(lengths), 1), dp_size=dp_size
        )
    except ValueError as exc:
        raise ExperienceInputError("dp_size", str(exc)) from None
    return tuple(tuple(plan.permutation(r)) for r in range(dp_size))
