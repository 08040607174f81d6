"""``TransferDock``: every rollout of recent generation steps, column by column, shared by the roles that
produce and consume it.

One table per generation step (``iteration``) of ``slots × group_size`` rows: row ``(slot, index)`` is the
``index``-th completion of the prompt in ``slot`` of that step's batch. Columns are named and each cell is
written once (writing the same value again is a no-op, so a retried write is safe; another value is refused).

Consumers are named roles that declare the columns they need (and may write). ``dispatch`` hands a consumer
up to ``count`` rows whose needed columns are all written and that it has not consumed, under a *lease*: no
other caller of that consumer gets those rows until the lease is collected or expires, when they return to
the pool. ``collect`` writes the consumer's results for the leased rows and marks them consumed. Each
consumer has its own consumption state, so roles never wait for each other, only for the columns they need.
Reads by index (``read``) and plain writes (``put``) never wait and claim nothing.

Every change is committed to SQLite before the call returns, leases included, so a ``kill -9`` loses nothing
acknowledged and a restarted store hands out exactly what it would have. Retention keeps the last
``keep_iterations`` tables. All methods are thread-safe; a claim is atomic.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from proctor.batching.dynamic import plan_dynamic_batches
from proctor.dock.errors import (
    CellConflictError,
    CellsMissingError,
    DockInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
)
from proctor.dock.persistence import DockTables, Lease, StoredTable
from proctor.dock.values import Value, decode_cell, encode_cell

__all__ = ["Collected", "Consumer", "Consumption", "Dispatch", "DockLimits", "RowKey", "TableInfo", "TransferDock"]

RowKey = tuple[int, int]
"""``(slot, index)``: a prompt's slot in the step's batch, and which of its completions."""

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")
_MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class DockLimits:
    """Bounds on what one call may ask for: each call's work is bounded by them."""

    max_slots: int = 65_536
    max_group_size: int = 4_096
    max_rows: int = 1 << 20
    """Rows in one table (slots × group_size)."""
    max_rows_per_call: int = 65_536
    max_columns: int = 64
    max_lease_s: float = 86_400.0


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
class TableInfo:
    iteration: int
    slots: int
    group_size: int
    written: Mapping[str, int]
    """Cells written so far, per column."""

    @property
    def rows(self) -> int:
        return self.slots * self.group_size


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
    held: int
    """Rows under a live lease."""
    ready: int
    """Rows it could be handed now."""

    @property
    def all_consumed(self) -> bool:
        return self.consumed == self.rows


@dataclass(slots=True)
class _Table:
    info: StoredTable
    written: dict[str, npt.NDArray[np.bool_]]
    consumed: dict[str, npt.NDArray[np.bool_]]
    held: dict[str, npt.NDArray[np.bool_]]

    @property
    def rows(self) -> int:
        return self.info.slots * self.info.group_size

    def mask(self, masks: dict[str, npt.NDArray[np.bool_]], name: str) -> npt.NDArray[np.bool_]:
        """The mask of ``name``, created (all False) on first use: only for a change about to be made, so that
        names a caller merely asks about take no memory."""
        found = masks.get(name)
        if found is None:
            found = masks[name] = np.zeros(self.rows, dtype=bool)
        return found

    def peek(self, masks: dict[str, npt.NDArray[np.bool_]], name: str) -> npt.NDArray[np.bool_]:
        """The mask of ``name`` to read (all False when there is none); never stored."""
        found = masks.get(name)
        return found if found is not None else np.zeros(self.rows, dtype=bool)


class TransferDock:
    """The store, in this process, durable in the SQLite file ``path`` (``:memory:`` for a throwaway one).

    Args:
        path: the SQLite file (the dataserver passes its state file).
        keep_iterations: tables kept; opening one more drops the oldest.
        clock: wall-clock seconds, for lease expiry (a lease outlives a restart, so not a monotonic clock).
    """

    def __init__(
        self,
        path: str | Path = ":memory:",
        *,
        keep_iterations: int = 8,
        synchronous: Literal["normal", "full"] = "normal",
        limits: DockLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep_iterations < 1:
            raise ValueError(f"keep_iterations must be at least 1, got {keep_iterations}")
        self.keep_iterations = keep_iterations
        self.limits = limits or DockLimits()
        self._clock = clock
        self._lock = threading.Lock()
        self._db = DockTables(path, synchronous=synchronous)
        self._tables: dict[int, _Table] = {}
        self._consumers: dict[str, Consumer] = {}
        self._leases: dict[str, Lease] = {}  # every lease of the tables kept, by token
        self._live: dict[str, Lease] = {}  # those still held: the ones expiry has to look at
        self._load()

    def _load(self) -> None:
        for info in self._db.tables():
            self._tables[info.iteration] = _Table(info, {}, {}, {})
        for iteration, name, row in self._db.written():
            table = self._tables.get(iteration)
            if table is not None:
                table.mask(table.written, name)[row] = True
        for name, needs, produces, dispatch_size in self._db.consumers():
            self._consumers[name] = Consumer(name, needs, produces, dispatch_size)
        for consumer, iteration, row in self._db.consumed():
            table = self._tables.get(iteration)
            if table is not None:
                table.mask(table.consumed, consumer)[row] = True
        for lease in self._db.leases():
            table = self._tables.get(lease.iteration)
            if table is None:
                continue
            self._leases[lease.lease] = lease
            if lease.state == "held":
                self._live[lease.lease] = lease
                table.mask(table.held, lease.consumer)[lease.rows] = True

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- tables ---------------------------------------------------------------------------------------------

    def open(self, iteration: int, *, slots: int, group_size: int) -> TableInfo:
        """Create the table of ``iteration`` (``slots`` prompts × ``group_size`` completions), or check that it
        has that shape. Opening a table beyond ``keep_iterations`` drops the oldest."""
        _check_count("iteration", iteration, 0, 2**62)
        _check_count("slots", slots, 1, self.limits.max_slots)
        _check_count("group_size", group_size, 1, self.limits.max_group_size)
        if slots * group_size > self.limits.max_rows:
            raise DockInputError(
                "slots", f"{slots} × group_size {group_size} rows is above the store's {self.limits.max_rows} per table"
            )
        with self._lock:
            table = self._tables.get(iteration)
            if table is not None:
                if (table.info.slots, table.info.group_size) != (slots, group_size):
                    raise ShapeConflictError(
                        f"iteration {iteration} is already open with {table.info.slots} slots × group_size "
                        f"{table.info.group_size}, not {slots} × {group_size}; every writer of a step must agree"
                    )
                return self._info(table)
            if self._tables and iteration < min(self._tables) and len(self._tables) >= self.keep_iterations:
                raise UnknownIterationError(
                    f"iteration {iteration} is older than every table kept (the store keeps the last "
                    f"{self.keep_iterations}); it was dropped by retention or comes too late"
                )
            info = StoredTable(iteration, slots, group_size)
            kept = sorted([*self._tables, iteration])
            dropped = kept[: max(0, len(kept) - self.keep_iterations)]
            with self._db.transaction():
                self._db.drop_tables(dropped)
                self._db.add_table(info)
            for old in dropped:
                del self._tables[old]
            if dropped:
                gone = set(dropped)
                self._leases = {k: v for k, v in self._leases.items() if v.iteration not in gone}
                self._live = {k: v for k, v in self._live.items() if v.iteration not in gone}
            table = self._tables[iteration] = _Table(info, {}, {}, {})
            return self._info(table)

    def tables(self) -> list[TableInfo]:
        """The tables kept, oldest first."""
        with self._lock:
            return [self._info(self._tables[i]) for i in sorted(self._tables)]

    def table(self, iteration: int) -> TableInfo:
        with self._lock:
            return self._info(self._table(iteration))

    def _info(self, table: _Table) -> TableInfo:
        written = {name: int(mask.sum()) for name, mask in sorted(table.written.items()) if mask.any()}
        return TableInfo(table.info.iteration, table.info.slots, table.info.group_size, written)

    def _table(self, iteration: int) -> _Table:
        table = self._tables.get(iteration)
        if table is None:
            kept = f"{min(self._tables)}..{max(self._tables)}" if self._tables else "none"
            raise UnknownIterationError(
                f"iteration {iteration} has no table (kept: {kept}); open it first, or it was dropped by retention"
            )
        return table

    # --- consumers ------------------------------------------------------------------------------------------

    def register(
        self, name: str, *, needs: Sequence[str], produces: Sequence[str] = (), dispatch_size: int | None = None
    ) -> Consumer:
        """Declare a consumer, or check that it is declared with these columns (registering is idempotent)."""
        _check_name("name", name)
        for field, columns in (("needs", needs), ("produces", produces)):
            if isinstance(columns, str):
                raise DockInputError(field, f"a list of column names, not the string {columns!r}")
            if len(columns) > self.limits.max_columns:
                raise DockInputError(field, f"{len(columns)} columns; at most {self.limits.max_columns}")
            for n, column in enumerate(columns):
                _check_name(f"{field}[{n}]", column)
        if not needs:
            raise DockInputError("needs", "a consumer needs at least one column, the one whose rows it reads")
        if dispatch_size is not None:
            _check_count("dispatch_size", dispatch_size, 1, self.limits.max_rows_per_call)
        consumer = Consumer(name, tuple(dict.fromkeys(needs)), tuple(dict.fromkeys(produces)), dispatch_size)
        with self._lock:
            known = self._consumers.get(name)
            if known is not None:
                if known != consumer:
                    raise ShapeConflictError(
                        f"consumer {name!r} is registered as needs={list(known.needs)}, produces="
                        f"{list(known.produces)}, dispatch_size={known.dispatch_size}; register it the same way, "
                        "or use another name"
                    )
                return known
            with self._db.transaction():
                self._db.add_consumer(name, consumer.needs, consumer.produces, dispatch_size)
            self._consumers[name] = consumer
            return consumer

    def consumers(self) -> list[Consumer]:
        with self._lock:
            return sorted(self._consumers.values(), key=lambda c: c.name)

    def _consumer(self, name: str) -> Consumer:
        consumer = self._consumers.get(name)
        if consumer is None:
            raise UnknownConsumerError(f"consumer {name!r} is not registered; register it with the columns it needs")
        return consumer

    # --- writes and reads by index ---------------------------------------------------------------------------

    def put(self, iteration: int, rows: Sequence[RowKey], columns: Mapping[str, Sequence[Value]]) -> None:
        """Write cells: ``columns[name][k]`` is the value of column ``name`` in row ``rows[k]``. Never waits."""
        with self._lock:
            table = self._table(iteration)
            index = self._rows(table, rows)
            fresh = self._fresh_cells(table, index, columns)
            with self._db.transaction():
                self._store_cells(table, fresh)
            self._mark_written(table, fresh)

    def read(
        self,
        iteration: int,
        rows: Sequence[RowKey],
        columns: Sequence[str],
        *,
        missing: Literal["error", "none"] = "error",
    ) -> dict[str, list[Value]]:
        """The values of ``columns`` in ``rows``; never waits. Cells not yet written are an error, or ``None``
        with ``missing="none"``."""
        if missing not in ("error", "none"):
            raise DockInputError("missing", f"{missing!r} is not 'error' or 'none'")
        with self._lock:
            table = self._table(iteration)
            index = self._rows(table, rows)
            for n, name in enumerate(columns):
                _check_name(f"columns[{n}]", name)
                if missing == "none":
                    continue
                absent = ~table.peek(table.written, name)[index]
                if absent.any():
                    first = [_key(table, int(r)) for r in index[absent][:5]]
                    raise CellsMissingError(
                        f"column {name!r} is not written in {int(absent.sum())} of the rows asked for "
                        f"(the first: {first}); read them once written, or dispatch them to wait for readiness"
                    )
            return self._values(table, index, columns)

    def _rows(self, table: _Table, rows: Sequence[RowKey]) -> npt.NDArray[np.int64]:
        if len(rows) > self.limits.max_rows_per_call:
            raise DockInputError("rows", f"{len(rows)} rows; at most {self.limits.max_rows_per_call} per call")
        slots, group = table.info.slots, table.info.group_size
        index = np.empty(len(rows), dtype=np.int64)
        for n, row in enumerate(rows):
            try:
                slot, k = row
            except (TypeError, ValueError):
                raise DockInputError(f"rows[{n}]", f"{row!r} is not a (slot, index) pair") from None
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (slot, k)):
                raise DockInputError(f"rows[{n}]", f"{row!r} is not a (slot, index) pair of integers")
            if not (0 <= slot < slots and 0 <= k < group):
                raise DockInputError(
                    f"rows[{n}]",
                    f"({slot}, {k}) is outside iteration {table.info.iteration}'s table of {slots} slots × "
                    f"group_size {group}",
                )
            index[n] = slot * group + k
        if len(np.unique(index)) != len(index):
            raise DockInputError("rows", "a row appears twice; give each row once")
        return index

    def _fresh_cells(
        self, table: _Table, index: npt.NDArray[np.int64], columns: Mapping[str, Sequence[Value]]
    ) -> dict[str, list[tuple[int, bytes]]]:
        """The cells to write, encoded, per column: those not written yet. A cell written before must hold the
        same value (a retried write), or nothing is written at all."""
        if len(columns) > self.limits.max_columns:
            raise DockInputError("columns", f"{len(columns)} columns; at most {self.limits.max_columns} per call")
        encoded: dict[str, list[bytes]] = {}
        for name, values in columns.items():
            _check_name(f"columns.{name}", name)
            if len(values) != len(index):
                raise DockInputError(f"columns.{name}", f"{len(values)} values for {len(index)} rows; send one per row")
            encoded[name] = [encode_cell(f"columns.{name}[{n}]", v) for n, v in enumerate(values)]
        iteration = table.info.iteration
        fresh: dict[str, list[tuple[int, bytes]]] = {}
        for name, cells in encoded.items():
            written = table.peek(table.written, name)
            again = [n for n in range(len(index)) if written[index[n]]]
            if again:
                stored = self._db.cells(iteration, name, [int(index[n]) for n in again])
                for n in again:
                    if stored.get(int(index[n])) != cells[n]:
                        raise CellConflictError(
                            f"column {name!r} of row {_key(table, int(index[n]))} in iteration {iteration} is "
                            "already written with another value; each column is written once per row"
                        )
            fresh[name] = [(int(index[n]), cells[n]) for n in range(len(index)) if not written[index[n]]]
        return fresh

    def _store_cells(self, table: _Table, fresh: Mapping[str, list[tuple[int, bytes]]]) -> None:
        """Write :meth:`_fresh_cells`' cells, inside the caller's transaction."""
        for name, cells in fresh.items():
            self._db.write_cells(table.info.iteration, name, cells)

    def _mark_written(self, table: _Table, fresh: Mapping[str, list[tuple[int, bytes]]]) -> None:
        """Record :meth:`_store_cells`' cells as written, once their transaction has committed."""
        for name, cells in fresh.items():
            if cells:
                table.mask(table.written, name)[[row for row, _ in cells]] = True

    def _values(self, table: _Table, index: npt.NDArray[np.int64], columns: Sequence[str]) -> dict[str, list[Value]]:
        out: dict[str, list[Value]] = {}
        rows = [int(r) for r in index]
        for name in columns:
            cells = self._db.cells(table.info.iteration, name, rows)
            out[name] = [decode_cell(cell) if (cell := cells.get(r)) is not None else None for r in rows]
        return out

    # --- consuming ------------------------------------------------------------------------------------------

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
    ) -> Dispatch:
        """Claim up to ``count`` rows ready for ``consumer`` (its ``dispatch_size`` when not given).

        ``iteration`` picks the table; without it, the oldest table with a ready row. ``groups`` hands out
        whole groups only (all completions of a prompt, once all are ready); ``count`` is then a multiple of
        the group size. ``dp_size`` splits the rows among that many readers; ``balance_by`` (a needed column:
        an array, whose length counts, or an integer) balances them by tokens with the dynamic-batching
        planner, under ``max_tokens_per_microbatch`` when given. The rows are leased for ``lease_s``
        seconds. Never waits: with no row ready, the dispatch is empty.
        """
        _check_count("dp_size", dp_size, 1, 4096)
        if not (0 < lease_s <= self.limits.max_lease_s):
            raise DockInputError("lease_s", f"{lease_s} is outside (0, {self.limits.max_lease_s:g}] seconds")
        if groups and balance_by is not None:
            raise DockInputError(
                "balance_by", "groups keeps a prompt's completions together and balance_by splits rows; ask for one"
            )
        with self._lock:
            c = self._consumer(consumer)
            want = count if count is not None else c.dispatch_size
            if want is None:
                raise DockInputError("count", f"consumer {consumer!r} has no dispatch_size; give count")
            _check_count("count", want, 1, self.limits.max_rows_per_call)
            if balance_by is not None and balance_by not in c.needs:
                raise DockInputError(
                    "balance_by", f"{balance_by!r} is not among consumer {consumer!r}'s needs {list(c.needs)}"
                )
            now = self._clock()
            self._expire(now)
            if iteration is not None:
                candidates = [self._table(iteration)]
            else:
                candidates = [self._tables[i] for i in sorted(self._tables)]
            for table in candidates:
                chosen = self._choose(table, c, want, groups)
                if len(chosen):
                    return self._claim(
                        table, c, chosen, now + lease_s, dp_size, groups, balance_by, max_tokens_per_microbatch
                    )
            return Dispatch(consumer, iteration, None, None, (), {}, ())

    def _ready(self, table: _Table, c: Consumer) -> npt.NDArray[np.bool_]:
        ready = ~table.peek(table.consumed, c.name) & ~table.peek(table.held, c.name)
        for name in c.needs:
            ready &= table.peek(table.written, name)
        return ready

    def _choose(self, table: _Table, c: Consumer, want: int, groups: bool) -> npt.NDArray[np.int64]:
        ready = self._ready(table, c)
        if not groups:
            return np.flatnonzero(ready)[:want].astype(np.int64)
        g = table.info.group_size
        if want % g:
            raise DockInputError(
                "count",
                f"{want} is not a multiple of iteration {table.info.iteration}'s group_size {g}; "
                "with groups, ask for whole groups",
            )
        whole = np.flatnonzero(ready.reshape(table.info.slots, g).all(axis=1))[: want // g]
        return (whole[:, None] * g + np.arange(g)[None, :]).reshape(-1).astype(np.int64)

    def _claim(
        self,
        table: _Table,
        c: Consumer,
        index: npt.NDArray[np.int64],
        expires_at: float,
        dp_size: int,
        groups: bool,
        balance_by: str | None,
        max_tokens: int | None,
    ) -> Dispatch:
        values = self._values(table, index, c.needs)
        if balance_by is not None:
            parts = _balanced(values[balance_by], dp_size, max_tokens)
        else:
            parts = _parts(len(index), dp_size, table.info.group_size if groups else 1)
        lease = Lease(secrets.token_hex(16), c.name, table.info.iteration, index, expires_at, "held")
        with self._db.transaction():
            self._db.add_lease(lease)
        self._leases[lease.lease] = self._live[lease.lease] = lease
        table.mask(table.held, c.name)[index] = True
        rows = tuple(_key(table, int(r)) for r in index)
        return Dispatch(c.name, table.info.iteration, lease.lease, expires_at, rows, values, parts)

    def _expire(self, now: float) -> None:
        """Return the rows of every lease past its expiry to the pool."""
        late = [lease for lease in self._live.values() if lease.expires_at <= now]
        if not late:
            return
        with self._db.transaction():
            for lease in late:
                self._db.set_lease(lease.lease, state="expired", expires_at=lease.expires_at)
        for lease in late:
            lease.state = "expired"
            del self._live[lease.lease]
            table = self._tables[lease.iteration]  # a lease leaves _live when its table is dropped
            table.mask(table.held, lease.consumer)[lease.rows] = False

    def _lease(self, token: str, now: float) -> Lease:
        lease = self._leases.get(token)
        if lease is None:
            raise LeaseError(
                f"lease {token[:8]}… is unknown: it was never handed out by this store, or its table was dropped "
                "by retention; drop this result"
            )
        if lease.state == "held" and lease.expires_at <= now:
            self._expire(now)
        if lease.state == "expired":
            raise LeaseError(
                f"lease {token[:8]}… of consumer {lease.consumer!r} expired {now - lease.expires_at:.1f}s ago; "
                "its rows went back to the pool and may be held by another worker: drop this result (renew a "
                "lease before it expires for work that takes longer)"
            )
        return lease

    def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Collected:
        """Write a consumer's results for the rows of ``lease`` (one value per row, in dispatch order) and mark
        them consumed. Collecting the same values again is a no-op; a lease that expired is refused."""
        with self._lock:
            now = self._clock()
            held = self._lease(lease, now)
            c = self._consumer(held.consumer)
            extra = [name for name in columns if name not in c.produces]
            if extra:
                raise DockInputError(
                    "columns",
                    f"consumer {c.name!r} does not produce {extra}; it produces {list(c.produces)} (register another "
                    "consumer, or another name, to write other columns)",
                )
            table = self._table(held.iteration)
            fresh = self._fresh_cells(table, held.rows, columns)
            collected = Collected(c.name, table.info.iteration, tuple(_key(table, int(r)) for r in held.rows))
            if held.state == "collected":  # a retry: the values it repeats were checked just above
                if any(fresh.values()):
                    with self._db.transaction():
                        self._store_cells(table, fresh)
                    self._mark_written(table, fresh)
                return collected
            # The results and the consumption in one transaction: a crash between them would leave rows whose
            # results are written but that are still leased, and then handed to another worker.
            with self._db.transaction():
                self._store_cells(table, fresh)
                self._db.mark_consumed(c.name, table.info.iteration, held.rows)
                self._db.set_lease(lease, state="collected", expires_at=held.expires_at)
            self._mark_written(table, fresh)
            held.state = "collected"
            del self._live[lease]
            table.mask(table.consumed, c.name)[held.rows] = True
            table.mask(table.held, c.name)[held.rows] = False
            return collected

    def renew(self, lease: str, lease_s: float = 60.0) -> float:
        """Extend a live lease to ``lease_s`` seconds from now; returns its new expiry."""
        if not (0 < lease_s <= self.limits.max_lease_s):
            raise DockInputError("lease_s", f"{lease_s} is outside (0, {self.limits.max_lease_s:g}] seconds")
        with self._lock:
            now = self._clock()
            held = self._lease(lease, now)
            if held.state == "collected":
                raise LeaseError(f"lease {lease[:8]}… was already collected; there is nothing left to renew")
            expires_at = now + lease_s
            with self._db.transaction():
                self._db.set_lease(lease, state="held", expires_at=expires_at)
            held.expires_at = expires_at
            return expires_at

    def consumption(self, consumer: str, iteration: int) -> Consumption:
        with self._lock:
            c = self._consumer(consumer)
            table = self._table(iteration)
            self._expire(self._clock())
            return Consumption(
                consumer,
                iteration,
                table.rows,
                int(table.peek(table.consumed, consumer).sum()),
                int(table.peek(table.held, consumer).sum()),
                int(self._ready(table, c).sum()),
            )

    def all_consumed(self, consumer: str, iteration: int) -> bool:
        """Whether ``consumer`` has collected every row of ``iteration``'s table."""
        return self.consumption(consumer, iteration).all_consumed


def _key(table: _Table, row: int) -> RowKey:
    slot, k = divmod(row, table.info.group_size)
    return (slot, k)


def _check_count(field: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DockInputError(field, f"{value!r} is not an integer")
    if not low <= value <= high:
        raise DockInputError(field, f"{value} is outside {low}..{high}")


def _check_name(field: str, name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME or not set(name) <= _NAME_CHARS:
        raise DockInputError(
            field, f"{name!r} is not a name: use 1 to {_MAX_NAME} of lower-case letters, digits, '_', '-' and '.'"
        )


def _parts(n: int, dp_size: int, unit: int) -> tuple[tuple[int, ...], ...]:
    """``n`` positions in ``dp_size`` contiguous parts of near-equal size, cut at multiples of ``unit`` (a
    group stays with one reader)."""
    units = n // unit
    bounds = [round(r * units / dp_size) * unit for r in range(dp_size + 1)]
    return tuple(tuple(range(bounds[r], bounds[r + 1])) for r in range(dp_size))


def _balanced(values: Iterable[Value], dp_size: int, max_tokens: int | None) -> tuple[tuple[int, ...], ...]:
    lengths = []
    for n, v in enumerate(values):
        length = len(v) if isinstance(v, np.ndarray | list) else v
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise DockInputError(
                "balance_by", f"row {n} has {v!r} there: balance by an array column or a positive integer one"
            )
        lengths.append(length)
    try:
        plan = plan_dynamic_batches(
            lengths, max_tokens_per_microbatch=max_tokens or max(sum(lengths), 1), dp_size=dp_size
        )
    except ValueError as exc:
        raise DockInputError("dp_size", str(exc)) from None
    return tuple(tuple(plan.permutation(r)) for r in range(dp_size))
