"""``ExperienceStore``: every rollout of recent generation steps, column by column, shared by the roles that
produce and consume it.

One table per generation step (``iteration``) of ``slots × group_size`` rows: row ``(slot, index)`` is the
``index``-th completion of the prompt in ``slot`` of that step's batch. The group size may be left open when the
table is opened (the dataserver opens a step's table when it samples it, before anyone says how many
completions a prompt gets); a prompt's rows are then those written so far. Columns are named and each cell is
written once (writing the same value again is a no-op, so a retried write is safe; another value is refused).
A column is written per row, or per slot (a value every row of the slot shares, such as its prompt).

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

import bisect
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from proctor.experience.consumers import (
    Collected,
    Consumer,
    Consumption,
    Dispatch,
    balanced_parts,
    even_parts,
)
from proctor.experience.database import Database
from proctor.experience.errors import (
    CellConflictError,
    CellsMissingError,
    ExperienceInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
)
from proctor.experience.limits import ExperienceLimits, check_count, check_name
from proctor.experience.persistence import ExperienceTables, Lease, pack_cells, unpack_cells
from proctor.experience.tables import FreshCells, Index, RowKey, Table, TableInfo, age_of, iteration_of
from proctor.experience.values import Value, decode_cells, encode_cell

__all__ = ["ExperienceStore"]

_WAIT_LOOK_S = 0.01  # how often a waiting dispatch looks for ready rows
_Found = TypeVar("_Found")
_Columns = Literal["values", "cells", "none"]  # what a claim hands out of its rows' needed columns
_CHUNK_CACHE_BYTES = 32 * 1024 * 1024


class ExperienceStore:
    """The store, in this process, durable in the SQLite file ``path`` (``:memory:`` for a throwaway one) or the
    PostgreSQL database at ``path`` (a ``postgresql://`` URL).

    Args:
        path: the SQLite file, a PostgreSQL URL, or a connection to share (the dataserver passes its state's writer, so
            that its own writes and the store's can be one transaction; the connection stays its caller's).
        keep_iterations: tables kept (of steps, and as many of loose rows); opening one more drops the oldest.
        clock: wall-clock seconds, for lease expiry (a lease outlives a restart, so not a monotonic clock).
    """

    def __init__(
        self,
        path: str | Path | Database = ":memory:",
        *,
        keep_iterations: int = 8,
        synchronous: Literal["normal", "full"] = "normal",
        limits: ExperienceLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep_iterations < 1:
            raise ValueError(f"keep_iterations must be at least 1, got {keep_iterations}")
        self.keep_iterations = keep_iterations
        self.limits = limits or ExperienceLimits()
        self._clock = clock
        self._lock = threading.RLock()
        self._db = ExperienceTables(path, synchronous=synchronous)
        self._tables: dict[int, Table] = {}
        # The kept iterations of each kind (steps, and tables of loose rows), oldest first: retention's order.
        self._ages: dict[bool, list[tuple[int, bool]]] = {False: [], True: []}
        self._consumers: dict[str, Consumer] = {}
        self._leases: dict[str, Lease] = {}  # every lease of the tables kept, by token
        self._live: dict[str, Lease] = {}  # those still held: the ones expiry has to look at
        # Per consumer, the tables that may have rows ready for it: a dispatch without an iteration looks at
        # these only. A table leaves when a dispatch finds nothing there, and comes back with a write to it,
        # or an expired lease of the consumer's in it.
        self._maybe: dict[str, set[int]] = {}
        self._chunks: OrderedDict[int, bytes] = OrderedDict()  # recently written or read chunks' cells
        self._chunk_bytes = 0
        self._load()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make the calls inside one transaction: one commit for all (say, the tables of several steps opened
        at once). A call that fails rolls back every call of the batch."""
        with self._lock:
            try:
                with self._db.transaction():
                    yield
            except BaseException:
                # What the calls before the failure changed in memory was rolled back on disk: read it again.
                self._tables, self._consumers, self._leases, self._live, self._maybe = {}, {}, {}, {}, {}
                self._ages = {False: [], True: []}
                self._chunks, self._chunk_bytes = OrderedDict(), 0  # rolled-back chunk ids are used again
                self._load()
                raise

    def _load(self) -> None:
        for info in self._db.tables():
            self._tables[info.iteration] = Table(info.iteration, info.slots, info.group_size, info.group_size or 0)
            bisect.insort(self._ages[info.iteration < 0], age_of(info.iteration))
        for chunk in self._db.chunks():
            table = self._tables.get(chunk.iteration)
            if table is None:
                continue
            if chunk.indices is not None and len(chunk.indices):
                table.grow(table.slots, int(chunk.indices.max()) + 1)
            self._place(table, chunk.name, chunk.slots, chunk.indices, chunk.id)
        for name, needs, produces, dispatch_size in self._db.consumers():
            self._consumers[name] = Consumer(name, needs, produces, dispatch_size)
            self._maybe[name] = set(self._tables)
        for lease in self._db.leases():
            table = self._tables.get(lease.iteration)
            if table is None:
                continue
            self._leases[lease.lease] = lease
            where = (lease.slots, lease.indices)
            if lease.state == "held":
                self._live[lease.lease] = lease
                table.mask(table.held, lease.consumer)[where] = True
            elif lease.state == "collected":
                table.mask(table.consumed, lease.consumer)[where] = True
            if lease.state != "expired":
                table.take(lease.consumer, len(lease.slots))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- tables ---------------------------------------------------------------------------------------------

    def open(self, iteration: int, *, slots: int, group_size: int | None = None) -> TableInfo:
        """Create the table of ``iteration`` (``slots`` prompts × ``group_size`` completions), or check that it
        has that shape. Without ``group_size`` a prompt's rows are those written so far, until an opening
        with a group size fixes it. Opening a table beyond ``keep_iterations`` drops the oldest.

        A negative ``iteration`` names a table of loose rows (completions of step ``-iteration - 1`` that fit
        none of its slots), kept beside the steps' tables and retained the same way."""
        check_count("iteration", iteration, -(2**62), 2**62)
        check_count("slots", slots, 1, self.limits.max_slots)
        if group_size is not None:
            check_count("group_size", group_size, 1, self.limits.max_group_size)
            if slots * group_size > self.limits.max_rows:
                raise ExperienceInputError(
                    "slots",
                    f"{slots} × group_size {group_size} rows is above the store's {self.limits.max_rows} per table",
                )
        with self._lock:
            table = self._tables.get(iteration)
            if table is not None:
                self._reshape(table, slots, group_size)
                return self._info(table)
            if not self._room_for(iteration):
                raise UnknownIterationError(
                    f"iteration {iteration} is older than every table kept (the store keeps the last "
                    f"{self.keep_iterations}); it was dropped by retention or comes too late"
                )
            table = Table(iteration, slots, group_size, group_size or 0)
            ages = self._ages[iteration < 0]
            at = bisect.bisect(ages, age_of(iteration))
            ages = [*ages[:at], age_of(iteration), *ages[at:]]
            dropped = [iteration_of(a) for a in ages[: max(0, len(ages) - self.keep_iterations)]]
            with self._db.transaction():
                self._db.drop_tables(dropped)
                self._db.add_table(table.stored())
            self._ages[iteration < 0] = ages[len(dropped) :]
            for old in dropped:
                del self._tables[old]
                for maybe in self._maybe.values():
                    maybe.discard(old)
            if dropped:
                gone = set(dropped)
                self._leases = {k: v for k, v in self._leases.items() if v.iteration not in gone}
                self._live = {k: v for k, v in self._live.items() if v.iteration not in gone}
            self._tables[iteration] = table
            for maybe in self._maybe.values():
                maybe.add(iteration)
            return self._info(table)

    def retains(self, iteration: int) -> bool:
        """Whether the table of ``iteration`` is kept, or would be if opened now (retention refuses one older
        than every table kept once they are ``keep_iterations``)."""
        with self._lock:
            return iteration in self._tables or self._room_for(iteration)

    def _room_for(self, iteration: int) -> bool:
        ages = self._ages[iteration < 0]
        return not (ages and age_of(iteration) < ages[0] and len(ages) >= self.keep_iterations)

    def _reshape(self, table: Table, slots: int, group_size: int | None) -> None:
        """Check an opening of an existing table against its shape; a first group size is set here."""
        shape = f"{table.slots} slots × group_size {table.group_size}"
        if table.slots != slots or (None not in (group_size, table.group_size) and group_size != table.group_size):
            raise ShapeConflictError(
                f"iteration {table.iteration} is already open with {shape}, not {slots} × {group_size}; every "
                "writer of a step must agree"
            )
        if group_size is None or table.group_size is not None:
            return
        if table.width > group_size:
            raise ShapeConflictError(
                f"iteration {table.iteration} already holds completion index {table.width - 1}, so its group size "
                f"cannot be {group_size}; every writer of a step must agree"
            )
        if slots * group_size > self.limits.max_rows:
            raise ExperienceInputError(
                "slots", f"{slots} × group_size {group_size} rows is above the store's {self.limits.max_rows} per table"
            )
        table.group_size = group_size
        with self._db.transaction():
            self._db.set_shape(table.stored())
        table.grow(slots, group_size)

    def add_slots(self, iteration: int, count: int) -> int:
        """Append ``count`` slots to a table (one of loose rows, say); returns the first new slot."""
        check_count("count", count, 1, self.limits.max_slots)
        with self._lock:
            table = self._table(iteration)
            first = table.slots
            if first + count > self.limits.max_slots:
                raise ExperienceInputError(
                    "count", f"{first} + {count} slots is above the store's {self.limits.max_slots}"
                )
            table.grow(first + count, table.width)
            with self._db.transaction():
                self._db.set_shape(table.stored())
            return first

    def kept(self) -> list[int]:
        """The iterations whose tables are kept, oldest first (cheaper than :meth:`tables`)."""
        with self._lock:
            return sorted(self._tables, key=age_of)

    def has(self, iteration: int) -> bool:
        """Whether the table of ``iteration`` is kept."""
        with self._lock:
            return iteration in self._tables

    def tables(self) -> list[TableInfo]:
        """The tables kept, oldest first."""
        with self._lock:
            return [self._info(self._tables[i]) for i in sorted(self._tables, key=age_of)]

    def table(self, iteration: int) -> TableInfo:
        with self._lock:
            return self._info(self._table(iteration))

    def _info(self, table: Table) -> TableInfo:
        written = {}
        for name in sorted(table.columns):
            column = table.columns[name]
            count = column.count * table.width if column.per_slot else column.count
            if count:
                written[name] = count
        return TableInfo(table.iteration, table.slots, table.group_size, written, table.width)

    def _table(self, iteration: int) -> Table:
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
        check_name("name", name)
        for what, columns in (("needs", needs), ("produces", produces)):
            if isinstance(columns, str):
                raise ExperienceInputError(what, f"a list of column names, not the string {columns!r}")
            if len(columns) > self.limits.max_columns:
                raise ExperienceInputError(what, f"{len(columns)} columns; at most {self.limits.max_columns}")
            for n, column in enumerate(columns):
                check_name(f"{what}[{n}]", column)
        if not needs:
            raise ExperienceInputError("needs", "a consumer needs at least one column, the one whose rows it reads")
        if dispatch_size is not None:
            check_count("dispatch_size", dispatch_size, 1, self.limits.max_rows_per_call)
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
            self._maybe[name] = set(self._tables)
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
            slots, indices = self._rows(table, rows)
            self._write(table, slots, indices, columns)

    def put_slots(self, iteration: int, slots: Sequence[int], columns: Mapping[str, Sequence[Value]]) -> None:
        """Write cells shared by every row of a slot (a prompt's text, say): ``columns[name][k]`` is the value
        of column ``name`` in each row of slot ``slots[k]``. A column is written per slot or per row in a
        table, never both. Never waits."""
        with self._lock:
            table = self._table(iteration)
            self._write(table, self._slots(table, slots), None, columns)

    def _write(self, table: Table, slots: Index, indices: Index | None, columns: Mapping[str, Sequence[Value]]) -> None:
        fresh = self._fresh_cells(table, slots, indices, columns)
        if indices is not None and len(indices):
            top = int(indices.max()) + 1
            if top > table.width:
                table.grow(table.slots, top)
        with self._db.transaction():
            stored = self._store_cells(table, fresh)
        self._mark_written(table, fresh, stored)

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
        return _decoded(self.read_cells(iteration, rows, columns, missing=missing))

    def read_cells(
        self,
        iteration: int,
        rows: Sequence[RowKey],
        columns: Sequence[str],
        *,
        missing: Literal["error", "none"] = "error",
    ) -> dict[str, list[bytes | None]]:
        """:meth:`read`, each cell as its stored bytes (:func:`proctor.experience.values.encode_cell`), for a
        caller that passes them on without decoding them (a server answering over HTTP)."""
        if missing not in ("error", "none"):
            raise ExperienceInputError("missing", f"{missing!r} is not 'error' or 'none'")
        with self._lock:
            table = self._table(iteration)
            slots, indices = self._rows(table, rows)
            for n, name in enumerate(columns):
                check_name(f"columns[{n}]", name)
                if missing == "none":
                    continue
                absent = ~self._written_at(table, name, slots, indices)
                if absent.any():
                    first = [(int(s), int(k)) for s, k in zip(slots[absent][:5], indices[absent][:5], strict=True)]
                    raise CellsMissingError(
                        f"column {name!r} is not written in {int(absent.sum())} of the rows asked for "
                        f"(the first: {first}); read them once written, or dispatch them to wait for readiness"
                    )
            return self._cell_bytes(table, slots, indices, columns)

    def _cells(
        self, table: Table, name: str, slots: Index, indices: Index | None
    ) -> tuple[Index, npt.NDArray[np.int32]] | None:
        """Each asked cell's chunk (0 where not written) and its position there; None for a column the table
        does not have. ``indices`` None asks for slots (of a column written per slot)."""
        column = table.columns.get(name)
        if column is None:
            return None
        if column.per_slot or indices is None:
            return column.chunk[slots], column.pos[slots]
        inside = indices < table.width  # an index past the rows written so far holds nothing yet
        s, k = np.where(inside, slots, 0), np.where(inside, indices, 0)
        return np.where(inside, column.chunk[s, k], 0), column.pos[s, k]

    def _written_at(self, table: Table, name: str, slots: Index, indices: Index | None) -> npt.NDArray[np.bool_]:
        found = self._cells(table, name, slots, indices)
        return np.zeros(len(slots), dtype=bool) if found is None else found[0] != 0

    def _capacity(self, table: Table) -> int:
        return table.group_size if table.group_size is not None else self.limits.max_group_size

    def _rows(self, table: Table, rows: Sequence[RowKey]) -> tuple[Index, Index]:
        if len(rows) > self.limits.max_rows_per_call:
            raise ExperienceInputError("rows", f"{len(rows)} rows; at most {self.limits.max_rows_per_call} per call")
        capacity = self._capacity(table)
        slots = np.empty(len(rows), dtype=np.int64)
        indices = np.empty(len(rows), dtype=np.int64)
        for n, row in enumerate(rows):
            try:
                slot, k = row
            except (TypeError, ValueError):
                raise ExperienceInputError(f"rows[{n}]", f"{row!r} is not a (slot, index) pair") from None
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (slot, k)):
                raise ExperienceInputError(f"rows[{n}]", f"{row!r} is not a (slot, index) pair of integers")
            if not (0 <= slot < table.slots and 0 <= k < capacity):
                raise ExperienceInputError(
                    f"rows[{n}]",
                    f"({slot}, {k}) is outside iteration {table.iteration}'s table of {table.slots} slots × "
                    + (f"group_size {table.group_size}" if table.group_size is not None else f"{capacity} indices"),
                )
            slots[n], indices[n] = slot, k
        if len(np.unique(slots * capacity + indices)) != len(rows):
            raise ExperienceInputError("rows", "a row appears twice; give each row once")
        return slots, indices

    def _slots(self, table: Table, slots: Sequence[int]) -> Index:
        if len(slots) > self.limits.max_rows_per_call:
            raise ExperienceInputError("slots", f"{len(slots)} slots; at most {self.limits.max_rows_per_call} per call")
        out = np.empty(len(slots), dtype=np.int64)
        for n, slot in enumerate(slots):
            if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < table.slots:
                raise ExperienceInputError(
                    f"slots[{n}]", f"{slot!r} is not a slot of iteration {table.iteration}'s {table.slots}"
                )
            out[n] = slot
        if len(np.unique(out)) != len(out):
            raise ExperienceInputError("slots", "a slot appears twice; give each slot once")
        return out

    def _fresh_cells(
        self, table: Table, slots: Index, indices: Index | None, columns: Mapping[str, Sequence[Value]]
    ) -> dict[str, FreshCells]:
        """The cells to write, encoded, per column: those not written yet. A cell written before must hold the
        same value (a retried write), or nothing is written at all."""
        if len(columns) > self.limits.max_columns:
            raise ExperienceInputError("columns", f"{len(columns)} columns; at most {self.limits.max_columns} per call")
        per_slot = indices is None
        fresh: dict[str, FreshCells] = {}
        for name, values in columns.items():
            check_name(f"columns.{name}", name)
            if len(values) != len(slots):
                raise ExperienceInputError(
                    f"columns.{name}", f"{len(values)} values for {len(slots)} rows; send one per row"
                )
            cells = [encode_cell(f"columns.{name}[{n}]", v) for n, v in enumerate(values)]
            column = table.columns.get(name)
            if column is not None and column.per_slot != per_slot:
                kind = "per slot" if column.per_slot else "per row"
                raise ExperienceInputError(
                    f"columns.{name}",
                    f"iteration {table.iteration} holds {name!r} {kind}; write it {kind} (a column is written one "
                    "way in a table)",
                )
            written = self._written_at(table, name, slots, indices)
            again = np.flatnonzero(written)
            if len(again):
                s = slots[again]
                stored = self._stored(table, name, s, None if indices is None else indices[again])
                for n, before in zip(again, stored, strict=True):
                    if before != cells[n]:
                        where = f"slot {slots[n]}" if indices is None else f"row ({slots[n]}, {indices[n]})"
                        raise CellConflictError(
                            f"column {name!r} of {where} in iteration {table.iteration} is already written "
                            "with another value; each column is written once per row"
                        )
            new = np.flatnonzero(~written)
            fresh[name] = FreshCells(
                slots[new], None if indices is None else indices[new], [cells[int(n)] for n in new]
            )
        return fresh

    def _store_cells(self, table: Table, fresh: Mapping[str, FreshCells]) -> dict[str, tuple[int, bytes]]:
        """Write :meth:`_fresh_cells`' cells, a chunk per column, inside the caller's transaction; returns each
        column's chunk id and cells."""
        names = [name for name, f in fresh.items() if f.cells]
        blobs = [pack_cells(fresh[name].cells) for name in names]
        chunks = [(name, fresh[name].slots, fresh[name].indices, blob) for name, blob in zip(names, blobs, strict=True)]
        ids = self._db.add_chunks(table.iteration, chunks)
        return {name: (chunk, blob) for name, chunk, blob in zip(names, ids, blobs, strict=True)}

    def _mark_written(
        self, table: Table, fresh: Mapping[str, FreshCells], stored: Mapping[str, tuple[int, bytes]]
    ) -> None:
        """Record :meth:`_store_cells`' chunks as written, once their transaction has committed."""
        for name, f in fresh.items():
            if name in stored:
                chunk, blob = stored[name]
                self._place(table, name, f.slots, f.indices, chunk)
                self._cache(chunk, blob)
        if stored:
            for maybe in self._maybe.values():
                maybe.add(table.iteration)

    def _place(
        self,
        table: Table,
        name: str,
        slots: Index | npt.NDArray[np.int32],
        indices: Index | npt.NDArray[np.int32] | None,
        chunk: int,
    ) -> None:
        column = table.column(name, indices is None)
        where = slots if indices is None else (slots, indices)
        column.chunk[where] = chunk
        column.pos[where] = np.arange(len(slots), dtype=np.int32)
        column.count += len(slots)  # only cells not written before are placed

    def _cache(self, chunk: int, blob: bytes) -> None:
        self._chunks[chunk] = blob
        self._chunk_bytes += len(blob)
        while self._chunk_bytes > _CHUNK_CACHE_BYTES and len(self._chunks) > 1:
            _, old = self._chunks.popitem(last=False)
            self._chunk_bytes -= len(old)

    def _blobs(self, chunks: Iterable[int]) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        absent = []
        for c in chunks:
            blob = self._chunks.get(c)
            if blob is None:
                absent.append(c)
            else:
                self._chunks.move_to_end(c)
                out[c] = blob
        if absent:
            for c, blob in self._db.cells(absent).items():
                out[c] = blob
                self._cache(c, blob)
        return out

    def _stored(self, table: Table, name: str, slots: Index, indices: Index | None) -> list[bytes | None]:
        """The stored bytes of one column's cells (None where not written)."""
        found = self._cells(table, name, slots, indices)
        if found is None:
            return [None] * len(slots)
        chunks, positions = found
        blobs = self._blobs(int(c) for c in np.unique(chunks) if c)
        by_chunk: dict[int, list[int]] = {}
        for n, c in enumerate(chunks):
            if c:
                by_chunk.setdefault(int(c), []).append(n)
        out: list[bytes | None] = [None] * len(slots)
        for c, ns in by_chunk.items():
            for n, cell in zip(ns, unpack_cells(blobs[c], [int(positions[n]) for n in ns]), strict=True):
                out[n] = cell
        return out

    def _cell_bytes(
        self, table: Table, slots: Index, indices: Index, columns: Sequence[str]
    ) -> dict[str, list[bytes | None]]:
        return {name: self._stored(table, name, slots, indices) for name in columns}

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
        wait_s: float = 0.0,
        cells: bool = False,
    ) -> Dispatch:
        """Claim up to ``count`` rows ready for ``consumer`` (its ``dispatch_size`` when not given).

        ``iteration`` picks the table; without it, the oldest table with a ready row. ``groups`` hands out
        whole groups only (all completions of a prompt, once all are ready); ``count`` is then a multiple of
        the group size. ``dp_size`` splits the rows among that many readers; ``balance_by`` (a needed column:
        an array, whose length counts, or an integer) balances them by tokens with the dynamic-batching
        planner, under ``max_tokens_per_microbatch`` when given. The rows are leased for ``lease_s``
        seconds. With no row ready, the dispatch is empty, at once or, with ``wait_s``, once that many seconds
        passed without one (the calling thread looks again every few milliseconds meanwhile, holding nothing).
        With ``cells``, the dispatch's columns hold each cell's stored bytes, as :meth:`read_cells` gives them.
        """
        return _looked(
            wait_s,
            lambda: self._dispatch(
                consumer,
                count,
                iteration,
                groups,
                dp_size,
                balance_by,
                max_tokens_per_microbatch,
                lease_s,
                "cells" if cells else "values",
            ),
            lambda batch: batch.lease is None,
        )

    def _dispatch(
        self,
        consumer: str,
        count: int | None,
        iteration: int | None,
        groups: bool,
        dp_size: int,
        balance_by: str | None,
        max_tokens_per_microbatch: int | None,
        lease_s: float,
        columns: _Columns,
    ) -> Dispatch:
        check_count("dp_size", dp_size, 1, 4096)
        self._check_lease_s(lease_s)
        if groups and balance_by is not None:
            raise ExperienceInputError(
                "balance_by", "groups keeps a prompt's completions together and balance_by splits rows; ask for one"
            )
        with self._lock:
            c = self._consumer(consumer)
            want = self._want(c, count)
            if balance_by is not None and balance_by not in c.needs:
                raise ExperienceInputError(
                    "balance_by", f"{balance_by!r} is not among consumer {consumer!r}'s needs {list(c.needs)}"
                )
            now = self._clock()
            self._expire(now)
            if iteration is not None:
                candidates = [self._table(iteration)]
                if groups and candidates[0].group_size is None:
                    raise ExperienceInputError(
                        "groups", f"iteration {iteration} has no group_size yet; open it with one to hand out groups"
                    )
            else:
                candidates = [self._tables[i] for i in sorted(self._maybe[c.name], key=age_of)]
                if groups:
                    candidates = [t for t in candidates if t.group_size is not None]
            for table in candidates:
                slots, indices = self._choose(table, c, want, groups)
                if len(slots):
                    return self._claim(
                        table,
                        c,
                        slots,
                        indices,
                        now + lease_s,
                        dp_size,
                        groups,
                        balance_by,
                        max_tokens_per_microbatch,
                        columns,
                    )
                if iteration is None and not groups:
                    self._maybe[c.name].discard(table.iteration)
            return Dispatch(consumer, iteration, None, None, (), {}, ())

    def dispatch_many(
        self,
        consumer: str,
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
        cells: bool = False,
    ) -> tuple[Dispatch, ...]:
        """Up to ``count`` rows ready for ``consumer`` in all, from up to ``tables`` tables, the oldest first: one
        :class:`Dispatch` per table, each under a lease of its own, in one transaction. Empty when no row is
        ready, at once or, with ``wait_s``, once that many seconds passed without one. A worker whose rows come
        one table at a time (each step of a run, each ``/grade`` outside one) makes one call for several."""
        check_count("tables", tables, 1, self.limits.max_tables_per_call)
        self._check_lease_s(lease_s)
        with self._lock:  # refused here, a bad request costs no rollback of the batch below
            want = self._want(self._consumer(consumer), count)
        columns: _Columns = "cells" if cells else "values"

        def look() -> tuple[Dispatch, ...]:
            found: list[Dispatch] = []
            with self._lock:
                self._expire(self._clock())
                # A look that can find nothing (a long poll's, mostly) opens no transaction.
                if self._maybe[consumer]:
                    with self.batch():
                        left = want
                        while len(found) < tables and left > 0:
                            batch = self._dispatch(consumer, left, None, False, 1, None, None, lease_s, columns)
                            if batch.lease is None:
                                break
                            found.append(batch)
                            left -= len(batch)
            return tuple(found)

        return _looked(wait_s, look, lambda found: not found)

    def _want(self, c: Consumer, count: int | None) -> int:
        """The rows a dispatch of ``c`` asks for: ``count``, or the consumer's ``dispatch_size``."""
        want = count if count is not None else c.dispatch_size
        if want is None:
            raise ExperienceInputError("count", f"consumer {c.name!r} has no dispatch_size; give count")
        check_count("count", want, 1, self.limits.max_rows_per_call)
        return want

    def claim(
        self, consumer: str, iteration: int, rows: Sequence[RowKey], *, lease_s: float = 60.0, read: bool = True
    ) -> Dispatch:
        """Lease exactly those of ``rows`` that are ready for ``consumer`` (in the order given); the others
        (held by another caller, consumed, or not ready) are left out. Never waits. With ``read=False`` the
        dispatch carries no columns: for a caller that holds the rows' values already (it just wrote them)."""
        self._check_lease_s(lease_s)
        with self._lock:
            c = self._consumer(consumer)
            table = self._table(iteration)
            slots, indices = self._rows(table, rows)
            now = self._clock()
            self._expire(now)
            inside = indices < table.width
            ready = np.zeros(len(slots), dtype=bool)
            ready[inside] = self._ready(table, c)[slots[inside], indices[inside]]
            if not ready.any():
                return Dispatch(consumer, iteration, None, None, (), {}, ())
            columns: _Columns = "values" if read else "none"
            return self._claim(table, c, slots[ready], indices[ready], now + lease_s, 1, False, None, None, columns)

    def _check_lease_s(self, lease_s: float) -> None:
        if not (0 < lease_s <= self.limits.max_lease_s):
            raise ExperienceInputError("lease_s", f"{lease_s} is outside (0, {self.limits.max_lease_s:g}] seconds")

    def _ready(self, table: Table, c: Consumer) -> npt.NDArray[np.bool_]:
        ready = ~table.peek(table.consumed, c.name) & ~table.peek(table.held, c.name)
        for name in c.needs:
            ready &= table.written(name)
        return ready

    def _choose(self, table: Table, c: Consumer, want: int, groups: bool) -> tuple[Index, Index]:
        if min(table.rows_written(need) for need in c.needs) <= table.taken.get(c.name, 0):
            # Every row whose needs are written is held or consumed: none is ready.
            return np.empty(0, np.int64), np.empty(0, np.int64)
        ready = self._ready(table, c)
        if not groups:
            flat = np.flatnonzero(ready)[:want]
            return (flat // table.width).astype(np.int64), (flat % table.width).astype(np.int64)
        g = table.width
        if want % g:
            raise ExperienceInputError(
                "count",
                f"{want} is not a multiple of iteration {table.iteration}'s group_size {g}; "
                "with groups, ask for whole groups",
            )
        whole = np.flatnonzero(ready.all(axis=1))[: want // g].astype(np.int64)
        return np.repeat(whole, g), np.tile(np.arange(g, dtype=np.int64), len(whole))

    def _claim(
        self,
        table: Table,
        c: Consumer,
        slots: Index,
        indices: Index,
        expires_at: float,
        dp_size: int,
        groups: bool,
        balance_by: str | None,
        max_tokens: int | None,
        columns: _Columns = "values",
    ) -> Dispatch:
        cells = self._cell_bytes(table, slots, indices, c.needs) if columns != "none" else {}
        values = _decoded(cells) if columns == "values" else cells
        if balance_by is not None:
            lengths = values[balance_by] if columns == "values" else decode_cells(cells[balance_by])
            parts = balanced_parts(lengths, dp_size, max_tokens)
        else:
            parts = even_parts(len(slots), dp_size, table.width if groups else 1)
        lease = Lease(
            secrets.token_hex(16),
            c.name,
            table.iteration,
            slots.astype(np.int32),
            indices.astype(np.int32),
            expires_at,
            "held",
        )
        with self._db.transaction():
            self._db.add_lease(lease)
        self._leases[lease.lease] = self._live[lease.lease] = lease
        table.mask(table.held, c.name)[slots, indices] = True
        table.take(c.name, len(slots))
        rows = tuple(zip(slots.tolist(), indices.tolist(), strict=True))
        return Dispatch(c.name, table.iteration, lease.lease, expires_at, rows, values, parts)

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
            table.mask(table.held, lease.consumer)[lease.slots, lease.indices] = False
            table.take(lease.consumer, -len(lease.slots))
            self._maybe[lease.consumer].add(lease.iteration)

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
                raise ExperienceInputError(
                    "columns",
                    f"consumer {c.name!r} does not produce {extra}; it produces {list(c.produces)} (register another "
                    "consumer, or another name, to write other columns)",
                )
            table = self._table(held.iteration)
            slots, indices = held.slots.astype(np.int64), held.indices.astype(np.int64)
            fresh = self._fresh_cells(table, slots, indices, columns)
            rows = tuple(zip(slots.tolist(), indices.tolist(), strict=True))
            collected = Collected(c.name, table.iteration, rows)
            if held.state == "collected":  # a retry: the values it repeats were checked just above
                if any(f.cells for f in fresh.values()):
                    with self._db.transaction():
                        stored = self._store_cells(table, fresh)
                    self._mark_written(table, fresh, stored)
                return collected
            # The results and the consumption in one transaction: a crash between them would leave rows whose
            # results are written but that are still leased, and then handed to another worker.
            with self._db.transaction():
                stored = self._store_cells(table, fresh)
                self._db.set_lease(lease, state="collected", expires_at=held.expires_at)
            self._mark_written(table, fresh, stored)
            held.state = "collected"
            del self._live[lease]
            table.mask(table.consumed, c.name)[slots, indices] = True
            table.mask(table.held, c.name)[slots, indices] = False
            return collected

    def collect_and_dispatch(
        self,
        lease: str,
        columns: Mapping[str, Sequence[Value]],
        count: int | None = None,
        *,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[Collected, Dispatch]:
        """:meth:`collect`, then :meth:`dispatch` of up to ``count`` rows for the same consumer: a worker's next rows
        with its results (over HTTP, one request). A refused collection dispatches nothing."""
        collected = self.collect(lease, columns)
        return collected, self.dispatch(collected.consumer, count, lease_s=lease_s, wait_s=wait_s)

    def collect_many(
        self, consumer: str, results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]]
    ) -> tuple[Collected | LeaseError, ...]:
        """:meth:`collect` of each ``(lease, columns)`` of ``consumer``, in one transaction. A lease the store
        refuses (unknown or expired) is answered with its :class:`LeaseError` in its place, and the others are
        collected; any other error refuses them all, and nothing is written."""
        check_count("collections", len(results), 0, self.limits.max_tables_per_call)
        with self._lock:  # refused here, a bad request costs no rollback of the batch below
            self._consumer(consumer)
            for n, (lease, _) in enumerate(results):
                held = self._leases.get(lease)
                if held is not None and held.consumer != consumer:
                    raise ExperienceInputError(
                        f"collections[{n}]",
                        f"lease {lease[:8]}… belongs to consumer {held.consumer!r}, not {consumer!r}",
                    )
        outcomes: list[Collected | LeaseError] = []
        with self.batch():
            for lease, columns in results:
                try:
                    outcomes.append(self.collect(lease, columns))
                except LeaseError as exc:  # raised before the lease's rows are touched
                    outcomes.append(exc)
        return tuple(outcomes)

    def collect_and_dispatch_many(
        self,
        consumer: str,
        results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]],
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[tuple[Collected | LeaseError, ...], tuple[Dispatch, ...]]:
        """:meth:`collect_many`, then :meth:`dispatch_many` for the same consumer: a worker's next rows with its
        results (over HTTP, one request)."""
        outcomes = self.collect_many(consumer, results)
        return outcomes, self.dispatch_many(consumer, count, tables=tables, lease_s=lease_s, wait_s=wait_s)

    def renew(self, lease: str, lease_s: float = 60.0) -> float:
        """Extend a live lease to ``lease_s`` seconds from now; returns its new expiry."""
        self._check_lease_s(lease_s)
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

    def claimed(self, consumer: str, iteration: int, rows: Sequence[RowKey]) -> int:
        """How many of ``rows`` ``consumer`` holds under a live lease or has consumed."""
        with self._lock:
            table = self._table(iteration)
            slots, indices = self._rows(table, rows)
            self._expire(self._clock())
            inside = indices < table.width
            s, k = slots[inside], indices[inside]
            taken = table.peek(table.consumed, consumer)[s, k] | table.peek(table.held, consumer)[s, k]
            return int(taken.sum())

    def all_consumed(self, consumer: str, iteration: int) -> bool:
        """Whether ``consumer`` has collected every row of ``iteration``'s table."""
        return self.consumption(consumer, iteration).all_consumed


def _looked(wait_s: float, look: Callable[[], _Found], empty: Callable[[_Found], bool]) -> _Found:
    """``look()`` until what it finds is not ``empty`` or ``wait_s`` seconds passed (looking again every few
    milliseconds, holding nothing meanwhile): its last outcome."""
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s <= 3600:
        raise ExperienceInputError("wait_s", f"{wait_s!r} is not a number of seconds in 0..3600")
    deadline = time.monotonic() + wait_s
    while True:
        found = look()
        left = deadline - time.monotonic()
        if not empty(found) or left <= 0:
            return found
        time.sleep(min(left, _WAIT_LOOK_S))


def _decoded(cells: Mapping[str, list[bytes | None]]) -> dict[str, list[Value]]:
    return {name: decode_cells(column) for name, column in cells.items()}
