"""``CellStore``: the tables of recent generation steps and their cells, durable, without the roles that consume
them (those are :class:`~proctor.experience.store.ExperienceStore`'s): opening and retaining tables, writing
cells once, reading them by index, and a cache of the column chunks they are stored in."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from proctor.experience.database import Database
from proctor.experience.errors import (
    CellConflictError,
    CellsMissingError,
    ExperienceInputError,
    ShapeConflictError,
    UnknownIterationError,
)
from proctor.experience.limits import ExperienceLimits, check_count, check_name
from proctor.experience.persistence import ExperienceTables, pack_cells, unpack_cells
from proctor.experience.tables import FreshCells, Index, RowKey, Table, TableInfo, age_of, iteration_of
from proctor.experience.values import Value, decode_columns, encode_cell

__all__ = ["CellStore"]

_CHUNK_CACHE_BYTES = 32 * 1024 * 1024


class CellStore:
    """The tables and their cells, in this process, durable in the SQLite file ``path`` (``:memory:`` for a
    throwaway one) or the PostgreSQL database at ``path`` (a ``postgresql://`` URL); see
    :class:`~proctor.experience.store.ExperienceStore` for the arguments.
    """

    def __init__(
        self,
        path: str | Path | Database = ":memory:",
        *,
        keep_iterations: int = 8,
        synchronous: Literal["normal", "full"] = "normal",
        limits: ExperienceLimits | None = None,
    ) -> None:
        if keep_iterations < 1:
            raise ValueError(f"keep_iterations must be at least 1, got {keep_iterations}")
        self.keep_iterations = keep_iterations
        self.limits = limits or ExperienceLimits()
        self._lock = threading.RLock()
        self._db = ExperienceTables(path, synchronous=synchronous)
        self._tables: dict[int, Table] = {}
        # The kept iterations of each kind (steps, and tables of loose rows), oldest first: retention's order.
        self._ages: dict[bool, list[tuple[int, bool]]] = {False: [], True: []}
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
                self._forget()
                self._load()
                raise

    def _forget(self) -> None:
        """Drop what memory holds of the store, to be read again (:meth:`_load`)."""
        self._tables, self._ages = {}, {False: [], True: []}
        self._chunks, self._chunk_bytes = OrderedDict(), 0  # rolled-back chunk ids are used again

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

    def _opened(self, iteration: int, dropped: Sequence[int]) -> None:
        """Told once a new table's opening has committed, with the tables retention dropped for it."""

    def _written(self, iteration: int) -> None:
        """Told once new cells of a table are committed."""

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
            self._tables[iteration] = table
            self._opened(iteration, dropped)
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
        return decode_columns(self.read_cells(iteration, rows, columns, missing=missing))

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
            self._written(table.iteration)

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
