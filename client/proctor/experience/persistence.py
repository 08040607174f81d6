"""The experience store's tables in SQLite or PostgreSQL: what must survive a ``kill -9`` and a restart.

Every change the store acknowledges is one committed transaction (WAL mode), so nothing acknowledged is lost.
The tables live in the dataserver's state file beside its own (a connection of the store's own), or in a file
of their own for an in-process store.

Cells are stored in *chunks*: one SQL row per column per write, holding that write's cells of the column and
the rows they belong to (``python -m bench experience_throughput`` measures rows and bytes per completion). A
row's consumption by a consumer is the collected lease that held it, so consuming writes no row per cell
either.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from proctor.experience.database import Database, is_postgresql

__all__ = ["Chunk", "ExperienceTables", "Lease", "StoredTable", "pack_cells", "unpack_cells"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experience_tables (
    iteration INTEGER PRIMARY KEY,
    slots INTEGER NOT NULL,
    group_size INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS experience_chunks (
    id INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    name TEXT NOT NULL,
    slots BLOB NOT NULL,
    indices BLOB,
    cells BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS experience_chunks_by_iteration ON experience_chunks (iteration);
CREATE TABLE IF NOT EXISTS experience_consumers (
    name TEXT PRIMARY KEY,
    needs TEXT NOT NULL,
    produces TEXT NOT NULL,
    dispatch_size INTEGER
);
CREATE TABLE IF NOT EXISTS experience_leases (
    lease TEXT PRIMARY KEY,
    consumer TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    slots BLOB NOT NULL,
    indices BLOB NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS experience_leases_by_iteration ON experience_leases (iteration);
"""

# Files written before the store's tables were named for it hold them as dock_*; they are renamed on opening.
_OLD_NAMES = {
    "dock_tables": "experience_tables",
    "dock_chunks": "experience_chunks",
    "dock_consumers": "experience_consumers",
    "dock_leases": "experience_leases",
}
_OLD_INDEXES = ("dock_chunks_by_iteration", "dock_leases_by_iteration")

# The layout before chunks: a SQL row per cell and per consumed row, rows numbered slot × group_size + index.
_CELL_LAYOUT = """
ALTER TABLE dock_tables RENAME TO dock_tables_cells;
ALTER TABLE dock_leases RENAME TO dock_leases_cells;
ALTER TABLE dock_consumers RENAME TO dock_consumers_cells;
"""

LeaseState = Literal["held", "collected", "expired"]
Int32s = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class StoredTable:
    iteration: int
    slots: int
    group_size: int | None


@dataclass(frozen=True, slots=True)
class Chunk:
    """Where one write's cells of one column went: their slots, and their indices (None for a column written
    per slot)."""

    id: int
    iteration: int
    name: str
    slots: Int32s
    indices: Int32s | None


@dataclass(slots=True)
class Lease:
    """A claim on rows ``(slots[n], indices[n])`` for one consumer; the store keeps it in memory as it is
    stored, and updates both."""

    lease: str
    consumer: str
    iteration: int
    slots: Int32s
    indices: Int32s
    expires_at: float
    state: LeaseState


def pack_cells(cells: Sequence[bytes]) -> bytes:
    """Encoded cells in one blob: their count, their end offsets, then their bytes."""
    ends = np.cumsum([len(c) for c in cells], dtype=np.int64)
    return struct.pack("<I", len(cells)) + ends.astype("<u8").tobytes() + b"".join(cells)


def unpack_cells(blob: bytes, positions: Sequence[int]) -> list[bytes]:
    """The cells at ``positions`` of a :func:`pack_cells` blob."""
    (n,) = struct.unpack_from("<I", blob)
    ends = np.frombuffer(blob, dtype="<u8", count=n, offset=4)
    base = 4 + 8 * n
    out = []
    for p in positions:
        start = base + (int(ends[p - 1]) if p else 0)
        out.append(blob[start : base + int(ends[p])])
    return out


def _ints(data: bytes | None) -> Int32s | None:
    return None if data is None else np.frombuffer(data, dtype="<i4").astype(np.int32)


def _blob(values: npt.NDArray[np.integer]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


_CHUNK_IDS = 256  # chunk ids a PostgreSQL connection takes from the sequence at once


class ExperienceTables:
    """One database connection; its caller (:class:`~proctor.experience.store.ExperienceStore`) uses it one call
    at a time."""

    def __init__(self, path: str | Path | Database, *, synchronous: Literal["normal", "full"] = "normal") -> None:
        # A connection given is its owner's (the dataserver's state, whose writes it shares, so that one
        # transaction can hold both): it is left open, and its settings as they are.
        self._owned = not isinstance(path, Database)
        if isinstance(path, Database):
            self._db = path
        elif is_postgresql(str(path)):
            self._db = Database.postgresql(str(path))
        else:
            self._db = Database.sqlite(path, synchronous=synchronous)
        # Earlier layouts exist only in SQLite files: PostgreSQL came after them.
        if self._db.dialect == "sqlite" and self._exists("dock_cells"):
            with self.transaction():
                self._from_cell_layout()
        elif self._db.dialect == "sqlite" and self._exists("dock_tables"):
            with self.transaction():
                self._from_old_names()
        self._db.script(_SCHEMA)
        self._ids: list[int] = []  # PostgreSQL's chunk ids taken ahead (_chunk_ids)

    def _exists(self, table: str) -> bool:
        return self._db.table_exists(table)

    def _from_old_names(self) -> None:
        for index in _OLD_INDEXES:
            self._db.execute(f"DROP INDEX IF EXISTS {index}")
        for old, new in _OLD_NAMES.items():
            if self._exists(old):
                self._db.execute(f"ALTER TABLE {old} RENAME TO {new}")

    def _from_cell_layout(self) -> None:
        """Move a file of the per-cell layout to chunks: a chunk per column of each table, a lease's flat rows
        as (slot, index) pairs. Consumption was the rows of the collected leases, which stay."""
        # Statement by statement: executescript would commit the transaction this runs in.
        for statement in (_CELL_LAYOUT + _SCHEMA).split(";"):
            if statement.strip():
                self._db.execute(statement)
        self._db.execute(
            "INSERT INTO experience_tables SELECT iteration, slots, group_size, created_at FROM dock_tables_cells"
        )
        groups = dict(self._db.execute("SELECT iteration, group_size FROM dock_tables_cells").fetchall())
        columns = self._db.execute("SELECT DISTINCT iteration, name FROM dock_cells").fetchall()
        for iteration, name in columns:
            cells = self._db.execute(
                "SELECT row, value FROM dock_cells WHERE iteration = ? AND name = ? ORDER BY row", (iteration, name)
            ).fetchall()
            rows = np.array([r for r, _ in cells], dtype=np.int64)
            self.add_chunk(
                iteration,
                name,
                rows // groups[iteration],
                rows % groups[iteration],
                pack_cells([bytes(v) for _, v in cells]),
            )
        for lease, consumer, iteration, rows_blob, expires_at, state in self._db.execute(
            "SELECT lease, consumer, iteration, rows, expires_at, state FROM dock_leases_cells"
        ).fetchall():
            if iteration not in groups:
                continue
            rows = np.frombuffer(rows_blob, dtype="<i8")
            g = groups[iteration]
            self.add_lease(Lease(lease, consumer, iteration, rows // g, rows % g, expires_at, state))
        self._db.execute(
            "INSERT INTO experience_consumers SELECT name, needs, produces, dispatch_size FROM dock_consumers_cells"
        )
        for table in ("dock_tables_cells", "dock_leases_cells", "dock_consumers_cells", "dock_cells", "dock_consumed"):
            self._db.execute(f"DROP TABLE IF EXISTS {table}")

    def close(self) -> None:
        if self._owned:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction; inside another, part of that one (committed or rolled back with it)."""
        if self._db.in_transaction:
            yield
            return
        self._db.begin()
        try:
            yield
        except BaseException:
            self._db.rollback()
            raise
        self._db.commit()

    # --- reads at start-up ----------------------------------------------------------------------------------

    def tables(self) -> list[StoredTable]:
        rows = self._db.execute("SELECT iteration, slots, group_size FROM experience_tables ORDER BY iteration")
        return [StoredTable(*r) for r in rows]

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk's rows, without its cells."""
        for id_, iteration, name, slots, indices in self._db.execute(
            "SELECT id, iteration, name, slots, indices FROM experience_chunks ORDER BY id"
        ):
            found = _ints(slots)
            assert found is not None
            yield Chunk(id_, iteration, name, found, _ints(indices))

    def consumers(self) -> Iterator[tuple[str, tuple[str, ...], tuple[str, ...], int | None]]:
        """Every consumer's (name, needs, produces, dispatch_size)."""
        for name, needs, produces, size in self._db.execute(
            "SELECT name, needs, produces, dispatch_size FROM experience_consumers"
        ):
            yield name, tuple(json.loads(needs)), tuple(json.loads(produces)), size

    def leases(self) -> list[Lease]:
        # The order leases were written in: SQLite's row id (PostgreSQL keeps none, and none is needed there).
        order = "rowid" if self._db.dialect == "sqlite" else "iteration, lease"
        rows = self._db.execute(
            "SELECT lease, consumer, iteration, slots, indices, expires_at, state FROM experience_leases"
            f" ORDER BY {order}"
        )
        out = []
        for lease, c, i, s, k, e, state in rows:
            slots, indices = _ints(s), _ints(k)
            assert slots is not None and indices is not None
            out.append(Lease(lease, c, i, slots, indices, e, state))
        return out

    # --- cells ----------------------------------------------------------------------------------------------

    def cells(self, chunks: Sequence[int]) -> dict[int, bytes]:
        """The cell blobs of the given chunks."""
        out: dict[int, bytes] = {}
        for start in range(0, len(chunks), 500):
            part = chunks[start : start + 500]
            marks = ",".join("?" * len(part))
            for id_, blob in self._db.execute(f"SELECT id, cells FROM experience_chunks WHERE id IN ({marks})", part):
                out[id_] = blob
        return out

    # --- writes (inside a transaction) ---------------------------------------------------------------------

    def add_table(self, table: StoredTable) -> None:
        self._db.defer(
            "INSERT INTO experience_tables (iteration, slots, group_size, created_at) VALUES (?, ?, ?, ?)",
            (table.iteration, table.slots, table.group_size, time.time()),
        )

    def set_shape(self, table: StoredTable) -> None:
        self._db.defer(
            "UPDATE experience_tables SET slots = ?, group_size = ? WHERE iteration = ?",
            (table.slots, table.group_size, table.iteration),
        )

    def drop_tables(self, iterations: Sequence[int]) -> None:
        for iteration in iterations:
            for table in ("experience_tables", "experience_chunks", "experience_leases"):
                self._db.defer(f"DELETE FROM {table} WHERE iteration = ?", (iteration,))

    def add_consumer(self, name: str, needs: Sequence[str], produces: Sequence[str], dispatch_size: int | None) -> None:
        self._db.execute(
            "INSERT INTO experience_consumers (name, needs, produces, dispatch_size) VALUES (?, ?, ?, ?)",
            (name, json.dumps(list(needs)), json.dumps(list(produces)), dispatch_size),
        )

    def add_chunk(
        self,
        iteration: int,
        name: str,
        slots: npt.NDArray[np.integer],
        indices: npt.NDArray[np.integer] | None,
        cells: bytes,
    ) -> int:
        """Store one write's cells of one column (a :func:`pack_cells` blob); returns the chunk's id."""
        if self._db.dialect != "sqlite":
            return self.add_chunks(iteration, [(name, slots, indices, cells)])[0]
        return self._db.insert(
            "INSERT INTO experience_chunks (iteration, name, slots, indices, cells) VALUES (?, ?, ?, ?, ?)",
            (iteration, name, _blob(slots), None if indices is None else _blob(indices), cells),
        )

    def add_chunks(
        self,
        iteration: int,
        chunks: Sequence[tuple[str, npt.NDArray[np.integer], npt.NDArray[np.integer] | None, bytes]],
    ) -> list[int]:
        """:meth:`add_chunk` for several columns of one write, ``(name, slots, indices, cells)`` each; returns
        their ids in order. On PostgreSQL the ids come from the table's sequence ahead of time, so that the insert
        goes with the transaction's next statement (:meth:`Database.defer`) rather than waiting for a round trip
        of its own to return them."""
        if self._db.dialect == "sqlite":
            return [self.add_chunk(iteration, name, slots, indices, cells) for name, slots, indices, cells in chunks]
        if not chunks:
            return []
        ids = self._chunk_ids(len(chunks))
        params: list[object] = []
        for id_, (name, slots, indices, cells) in zip(ids, chunks, strict=True):
            params += [id_, iteration, name, _blob(slots), None if indices is None else _blob(indices), cells]
        self._db.defer(
            "INSERT INTO experience_chunks (id, iteration, name, slots, indices, cells) VALUES "
            + ",".join(["(?, ?, ?, ?, ?, ?)"] * len(chunks)),
            params,
        )
        return ids

    def _chunk_ids(self, n: int) -> list[int]:
        """``n`` chunk ids from the sequence, taken a few hundred at a time. A sequence is not rolled back: an id
        taken in a transaction that fails is never used, and one taken by another server never twice."""
        while len(self._ids) < n:
            taken = self._db.execute(
                "SELECT nextval(pg_get_serial_sequence('experience_chunks', 'id')) FROM generate_series(1, ?)",
                (max(n, _CHUNK_IDS),),
            ).fetchall()
            self._ids += [int(i) for (i,) in taken]
        ids, self._ids = self._ids[:n], self._ids[n:]
        return ids

    def add_lease(self, lease: Lease) -> None:
        self._db.defer(
            "INSERT INTO experience_leases (lease, consumer, iteration, slots, indices, expires_at, state)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                lease.lease,
                lease.consumer,
                lease.iteration,
                _blob(lease.slots),
                _blob(lease.indices),
                lease.expires_at,
                lease.state,
            ),
        )

    def set_lease(self, lease: str, *, state: LeaseState, expires_at: float) -> None:
        self._db.defer(
            "UPDATE experience_leases SET state = ?, expires_at = ? WHERE lease = ?", (state, expires_at, lease)
        )
