"""The experience store's HTTP schema, shared by the dataserver's ``/experience`` routes and the experience client.

Columns travel as ``{"values": [...]}`` (JSON values, one per row) or ``{"arrays": [...]}`` (numpy arrays,
one per row, each its dtype, shape and base64 bytes). Every number is bounded here; the store checks the rest
(shapes, names, leases) and answers with its own error classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from proctor.experience.consumers import Collected, Consumer, Consumption, Dispatch
from proctor.experience.errors import ExperienceInputError, LeaseError
from proctor.experience.limits import ExperienceLimits
from proctor.experience.tables import TableInfo
from proctor.experience.values import (
    MAX_NDIM,
    Value,
    cell_json,
    cell_wire_array,
    from_wire_array,
    to_wire_array,
)

__all__ = [
    "CollectManyRequest",
    "CollectRequest",
    "CollectedBody",
    "CollectedManyBody",
    "CollectedRowsBody",
    "Collection",
    "ConsumerBody",
    "ConsumptionBody",
    "DispatchBody",
    "DispatchManyRequest",
    "DispatchRequest",
    "DispatchesBody",
    "ExperienceOverview",
    "OpenRequest",
    "PutRequest",
    "ReadBody",
    "ReadRequest",
    "RefusedBody",
    "RegisterRequest",
    "RenewBody",
    "RenewRequest",
    "TableBody",
    "WireArray",
    "WireColumn",
    "collected_many_json",
    "column_from_wire",
    "column_to_wire",
    "columns_from_wire",
    "columns_to_wire",
    "dispatch_json",
    "dispatches_json",
    "read_json",
]

_LIMITS = ExperienceLimits()  # the store's bounds, which the wire states in the schema
MAX_ROWS = _LIMITS.max_rows_per_call
MAX_TABLES = _LIMITS.max_tables_per_call  # tables a dispatch_many takes, leases a collect_many collects
_Index = Annotated[int, Field(ge=0, le=2**31)]
_Name = Annotated[str, Field(min_length=1, max_length=64)]
_Row = tuple[_Index, _Index]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WireArray(_Wire):
    dtype: Annotated[str, Field(max_length=16)]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(max_length=MAX_NDIM)]
    data: str = Field(description="The array's little-endian bytes, base64-encoded.")


class WireColumn(_Wire):
    """One value per row: ``values`` (JSON) or ``arrays`` (numpy arrays, or null where a row has none, as a
    read with ``missing: none`` answers), exactly one of them."""

    values: Annotated[list[Any], Field(max_length=MAX_ROWS)] | None = None
    arrays: Annotated[list[WireArray | None], Field(max_length=MAX_ROWS)] | None = None

    @model_validator(mode="after")
    def _one(self) -> WireColumn:
        if (self.values is None) == (self.arrays is None):
            raise ValueError("send exactly one of values (JSON, one per row) and arrays (one per row)")
        return self

    def __len__(self) -> int:
        return len(self.values if self.values is not None else self.arrays or [])


def column_to_wire(name: str, values: Sequence[Value]) -> WireColumn:
    """A column's values as the wire carries them (arrays when every value is a numpy array or None, and one
    is an array)."""
    arrays = [isinstance(v, np.ndarray) for v in values]
    if any(arrays) and all(a or v is None for a, v in zip(arrays, values, strict=True)):
        return WireColumn(arrays=[None if v is None else WireArray(**to_wire_array(v)) for v in values])
    if any(arrays):
        raise ExperienceInputError(f"columns.{name}", "mixes numpy arrays and other values; send one kind per column")
    return WireColumn(values=list(values))


def column_from_wire(field: str, column: WireColumn) -> list[Value]:
    if column.values is not None:
        return column.values
    assert column.arrays is not None
    return [
        None if a is None else from_wire_array(f"{field}.arrays[{n}]", a.dtype, a.shape, a.data)
        for n, a in enumerate(column.arrays)
    ]


def columns_to_wire(columns: Mapping[str, Sequence[Value]]) -> dict[str, WireColumn]:
    return {name: column_to_wire(name, values) for name, values in columns.items()}


def _column_json(name: str, cells: Sequence[bytes | None]) -> bytes:
    """:func:`column_to_wire`'s JSON for the values whose stored bytes are ``cells``, without decoding them."""
    texts = [None if cell is None else cell_json(cell) for cell in cells]
    if all(t is not None or c is None for t, c in zip(texts, cells, strict=True)):
        return b'{"values":[' + b",".join(b"null" if t is None else t for t in texts) + b"]}"
    if any(t is not None and t != b"null" for t in texts):
        raise ExperienceInputError(f"columns.{name}", "mixes numpy arrays and other values; send one kind per column")
    arrays = [None if t is not None or c is None else cell_wire_array(c) for t, c in zip(texts, cells, strict=True)]
    return b'{"arrays":' + json.dumps(arrays, separators=(",", ":")).encode() + b"}"


def _columns_json(cells: Mapping[str, Sequence[bytes | None]]) -> bytes:
    fields = (json.dumps(name).encode() + b":" + _column_json(name, column) for name, column in cells.items())
    return b"{" + b",".join(fields) + b"}"


def read_json(cells: Mapping[str, Sequence[bytes | None]]) -> bytes:
    """A :class:`ReadBody` as JSON, from the store's cells (:meth:`ExperienceStore.read_cells`): JSON values go
    out as they are stored, arrays as their stored bytes in base64, none of them decoded and encoded again."""
    return b'{"columns":' + _columns_json(cells) + b"}"


def dispatch_json(d: Dispatch) -> bytes:
    """A :class:`DispatchBody` as JSON, for a dispatch whose columns hold the store's cells (``cells=True``)."""
    head = {
        "consumer": d.consumer,
        "iteration": d.iteration,
        "lease": d.lease,
        "expires_at": d.expires_at,
        "rows": [list(r) for r in d.rows],
        "parts": [list(p) for p in d.parts],
    }
    return json.dumps(head, separators=(",", ":")).encode()[:-1] + b',"columns":' + _columns_json(d.columns) + b"}"


def collected_json(c: Collected, dispatched: bytes | None = None) -> bytes:
    """A :class:`CollectedBody` as JSON, with ``dispatched`` (a :func:`dispatch_json`) as its ``next``."""
    head = CollectedBody.of(c).model_dump_json(exclude={"next"}).encode()
    return head if dispatched is None else head[:-1] + b',"next":' + dispatched + b"}"


def dispatches_json(dispatches: Sequence[Dispatch]) -> bytes:
    """A :class:`DispatchesBody` as JSON, from dispatches whose columns hold the store's cells."""
    return b'{"dispatches":[' + b",".join(dispatch_json(d) for d in dispatches) + b"]}"


def collected_many_json(
    leases: Sequence[str], outcomes: Sequence[Collected | LeaseError], dispatched: bytes | None = None
) -> bytes:
    """A :class:`CollectedManyBody` as JSON, with ``dispatched`` (a :func:`dispatches_json`) as its ``next``."""
    parts = [
        RefusedBody(lease=lease, refused=o.message) if isinstance(o, LeaseError) else CollectedRowsBody.of(o)
        for lease, o in zip(leases, outcomes, strict=True)
    ]
    head = CollectedManyBody(collected=parts).model_dump_json(exclude={"next"}).encode()
    return head if dispatched is None else head[:-1] + b',"next":' + dispatched + b"}"


def columns_from_wire(columns: Mapping[str, WireColumn]) -> dict[str, list[Value]]:
    return {name: column_from_wire(f"columns.{name}", column) for name, column in columns.items()}


class OpenRequest(_Wire):
    slots: int = Field(ge=1, le=2**31, description="Prompts in the step's batch.")
    group_size: int | None = Field(
        default=None, ge=1, le=2**31, description="Completions per prompt; left out, the table's own (if set)."
    )


class TableBody(_Wire):
    iteration: int
    slots: int
    group_size: int | None = Field(description="Completions per prompt; null until a writer that knows it sets it.")
    width: int = Field(description="Rows per slot so far.")
    rows: int
    written: dict[str, int] = Field(description="Cells written so far, per column.")

    @classmethod
    def of(cls, info: TableInfo) -> TableBody:
        return cls(
            iteration=info.iteration,
            slots=info.slots,
            group_size=info.group_size,
            width=info.width,
            rows=info.rows,
            written=dict(info.written),
        )

    def info(self) -> TableInfo:
        return TableInfo(self.iteration, self.slots, self.group_size, self.written, self.width)


class RegisterRequest(_Wire):
    needs: Annotated[list[_Name], Field(min_length=1, max_length=64)]
    produces: Annotated[list[_Name], Field(max_length=64)] = []
    dispatch_size: int | None = Field(default=None, ge=1, le=MAX_ROWS)


class ConsumerBody(_Wire):
    name: str
    needs: list[str]
    produces: list[str]
    dispatch_size: int | None

    @classmethod
    def of(cls, c: Consumer) -> ConsumerBody:
        return cls(name=c.name, needs=list(c.needs), produces=list(c.produces), dispatch_size=c.dispatch_size)

    def consumer(self) -> Consumer:
        return Consumer(self.name, tuple(self.needs), tuple(self.produces), self.dispatch_size)


class PutRequest(_Wire):
    rows: Annotated[list[_Row], Field(max_length=MAX_ROWS)] = Field(description="(slot, index) of each row.")
    columns: Annotated[dict[_Name, WireColumn], Field(max_length=64)]
    read: Annotated[list[_Name], Field(max_length=64)] = Field(
        default_factory=list,
        description="Columns to answer for these rows once all are written (such as the grader role's rewards, "
        "for the completions written): a 200 with their values, as a read's. None: a 204 at once.",
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="With read, how long to wait for its cells to be written before the 409.",
    )


class ReadRequest(_Wire):
    rows: Annotated[list[_Row], Field(max_length=MAX_ROWS)]
    columns: Annotated[list[_Name], Field(min_length=1, max_length=64)]
    missing: Literal["error", "none"] = Field(
        default="error", description="Unwritten cells: a 409 (error), or null values (none)."
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="With missing=error, how long to wait for unwritten cells to be written before the 409.",
    )


class ReadBody(_Wire):
    columns: dict[str, WireColumn]


MAX_DISPATCH_WAIT_S = 30.0


_LeaseS = Annotated[float, Field(gt=0, le=_LIMITS.max_lease_s, description="Seconds the rows are held.")]
_WaitS = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_DISPATCH_WAIT_S,
        description="With no row ready: seconds to wait for one before answering empty (a long poll); 0 answers "
        "at once.",
    ),
]


class DispatchRequest(_Wire):
    count: int | None = Field(default=None, ge=1, le=MAX_ROWS, description="Rows; the consumer's dispatch_size.")
    iteration: int | None = Field(default=None, ge=-(2**62), le=2**62, description="The table; the oldest ready one.")
    groups: bool = Field(default=False, description="Whole groups only (every completion of a prompt).")
    dp_size: int = Field(default=1, ge=1, le=4096, description="Readers to split the rows among.")
    balance_by: _Name | None = Field(default=None, description="A needed column whose lengths balance the readers.")
    max_tokens_per_microbatch: int | None = Field(default=None, ge=1, le=2**40)
    lease_s: _LeaseS = 60.0
    wait_s: _WaitS = 0.0


class DispatchBody(_Wire):
    consumer: str
    iteration: int | None
    lease: str | None
    expires_at: float | None
    rows: list[tuple[int, int]]
    columns: dict[str, WireColumn]
    parts: list[list[int]]

    def dispatch(self) -> Dispatch:
        return Dispatch(
            self.consumer,
            self.iteration,
            self.lease,
            self.expires_at,
            tuple((s, k) for s, k in self.rows),
            columns_from_wire(self.columns),
            tuple(tuple(p) for p in self.parts),
        )


class CollectRequest(_Wire):
    columns: Annotated[dict[_Name, WireColumn], Field(max_length=64)] = {}
    next: DispatchRequest | None = Field(
        default=None,
        description="Then dispatch the consumer's next rows, as its /dispatch with this body would (``wait_s`` a "
        "long poll), answered in ``next``: a worker's one request where it would make two. A dispatch the store "
        "refuses answers its refusal with the collection stored (collecting it again writes nothing twice).",
    )


class CollectedRowsBody(_Wire):
    consumer: str
    iteration: int
    rows: list[tuple[int, int]] = Field(description="(slot, index) of each row consumed, in dispatch order.")

    @classmethod
    def of(cls, c: Collected) -> Self:
        return cls(consumer=c.consumer, iteration=c.iteration, rows=[(s, k) for s, k in c.rows])

    def collected(self) -> Collected:
        return Collected(self.consumer, self.iteration, tuple((s, k) for s, k in self.rows))


class CollectedBody(CollectedRowsBody):
    next: DispatchBody | None = Field(default=None, description="The next dispatch, when the request asked for it.")


class DispatchManyRequest(_Wire):
    count: int | None = Field(default=None, ge=1, le=MAX_ROWS, description="Rows in all; the consumer's dispatch_size.")
    tables: int = Field(
        default=8, ge=1, le=MAX_TABLES, description="Tables the rows may come from, the oldest first: a dispatch each."
    )
    lease_s: _LeaseS = 60.0
    wait_s: _WaitS = 0.0


class DispatchesBody(_Wire):
    dispatches: list[DispatchBody] = Field(
        description="One per table, the oldest first, each with a lease of its own; none when no row is ready."
    )

    def all(self) -> tuple[Dispatch, ...]:
        return tuple(d.dispatch() for d in self.dispatches)


class Collection(_Wire):
    lease: str = Field(min_length=1, max_length=64, description="The lease a dispatch returned.")
    columns: Annotated[dict[_Name, WireColumn], Field(max_length=64)] = {}


class CollectManyRequest(_Wire):
    collections: Annotated[list[Collection], Field(max_length=MAX_TABLES)] = Field(
        description="The consumer's results, a lease each, collected in one transaction."
    )
    next: DispatchManyRequest | None = Field(
        default=None,
        description="Then dispatch the consumer's next rows, as its /dispatches with this body would, answered in "
        "``next``: a worker's one request where it would make two.",
    )


class RefusedBody(_Wire):
    lease: str
    refused: str = Field(description="Why the store refused the lease (unknown or expired): drop its results.")


class CollectedManyBody(_Wire):
    collected: list[CollectedRowsBody | RefusedBody] = Field(
        description="Per collection, in the request's order: the rows it consumed, or why its lease was refused."
    )
    next: DispatchesBody | None = Field(default=None, description="The next dispatches, when the request asked.")

    def outcomes(self) -> tuple[Collected | LeaseError, ...]:
        return tuple(LeaseError(c.refused) if isinstance(c, RefusedBody) else c.collected() for c in self.collected)


class RenewRequest(_Wire):
    lease_s: _LeaseS = 60.0


class RenewBody(_Wire):
    expires_at: float


class ConsumptionBody(_Wire):
    consumer: str
    iteration: int
    rows: int
    consumed: int
    held: int
    ready: int
    all_consumed: bool

    @classmethod
    def of(cls, c: Consumption) -> ConsumptionBody:
        return cls(
            consumer=c.consumer,
            iteration=c.iteration,
            rows=c.rows,
            consumed=c.consumed,
            held=c.held,
            ready=c.ready,
            all_consumed=c.all_consumed,
        )

    def consumption(self) -> Consumption:
        return Consumption(self.consumer, self.iteration, self.rows, self.consumed, self.held, self.ready)


class ExperienceOverview(_Wire):
    keep_iterations: int
    tables: list[TableBody]
    consumers: list[ConsumerBody]
