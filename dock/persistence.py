"""The experience store's tables in SQLite: what must survive a ``kill -9`` and a restart.

Every change the store acknowledges is one committed transaction (WAL mode), so nothing acknowledged is lost.
The tables live in the dataserver's state file beside its own (a connection of the store's own), or in a file
of their own for an in-process store.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["DockTables", "Lease", "StoredTable"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dock_tables (
    iteration INTEGER PRIMARY KEY,
    slots INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS dock_cells (
    id INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    name TEXT NOT NULL,
    row INTEGER NOT NULL,
    value BLOB NOT NULL,
    UNIQUE (iteration, name, row)
);
CREATE TABLE IF NOT EXISTS dock_consumers (
    name TEXT PRIMARY KEY,
    needs TEXT NOT NULL,
    produces TEXT NOT NULL,
    dispatch_size INTEGER
);
CREATE TABLE IF NOT EXISTS dock_leases (
    lease TEXT PRIMARY KEY,
    consumer TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    rows BLOB NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS dock_leases_by_iteration ON dock_leases (iteration);
CREATE TABLE IF NOT EXISTS dock_consumed (
    consumer TEXT NOT NULL,
    iteration INTEGER NOT NULL,
    row INTEGER NOT NULL,
    PRIMARY KEY (consumer, iteration, row)
) WITHOUT ROWID;
"""

_CELLS_PER_STATEMENT = 500  # 4 values each: far below SQLite's limit of 32,766 bound values

LeaseState = Literal["held", "collected", "expired"]


@dataclass(frozen=True, slots=True)
class StoredTable:
    iteration: int
    slots: int
    group_size: int


@dataclass(slots=True)
class Lease:
    """A claim on rows for one consumer; the store keeps it in memory as it is stored, and updates both."""

    lease: str
    consumer: str
    iteration: int
    rows: npt.NDArray[np.int64]
    expires_at: float
    state: LeaseState


class DockTables:
    """One SQLite connection; its caller (:class:`~proctor.dock.dock.TransferDock`) uses it one call at a time."""

    def __init__(self, path: str | Path, *, synchronous: Literal["normal", "full"] = "normal") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # --- reads at start-up ----------------------------------------------------------------------------------

    def tables(self) -> list[StoredTable]:
        rows = self._db.execute("SELECT iteration, slots, group_size FROM dock_tables ORDER BY iteration")
        return [StoredTable(*r) for r in rows]

    def written(self) -> Iterator[tuple[int, str, int]]:
        """Every written cell's (iteration, column, row), without its value."""
        yield from self._db.execute("SELECT iteration, name, row FROM dock_cells")

    def consumers(self) -> Iterator[tuple[str, tuple[str, ...], tuple[str, ...], int | None]]:
        """Every consumer's (name, needs, produces, dispatch_size)."""
        for name, needs, produces, size in self._db.execute(
            "SELECT name, needs, produces, dispatch_size FROM dock_consumers"
        ):
            yield name, tuple(json.loads(needs)), tuple(json.loads(produces)), size

    def consumed(self) -> Iterator[tuple[str, int, int]]:
        yield from self._db.execute("SELECT consumer, iteration, row FROM dock_consumed")

    def leases(self) -> list[Lease]:
        rows = self._db.execute("SELECT lease, consumer, iteration, rows, expires_at, state FROM dock_leases")
        return [
            Lease(lease, c, i, np.frombuffer(r, dtype="<i8").astype(np.int64), e, s) for lease, c, i, r, e, s in rows
        ]

    # --- writes (inside a transaction) ---------------------------------------------------------------------

    def add_table(self, table: StoredTable) -> None:
        self._db.execute(
            "INSERT INTO dock_tables (iteration, slots, group_size, created_at) VALUES (?, ?, ?, ?)",
            (table.iteration, table.slots, table.group_size, time.time()),
        )

    def drop_tables(self, iterations: Sequence[int]) -> None:
        for iteration in iterations:
            for table in ("dock_tables", "dock_cells", "dock_leases", "dock_consumed"):
                self._db.execute(f"DELETE FROM {table} WHERE iteration = ?", (iteration,))

    def add_consumer(self, name: str, needs: Sequence[str], produces: Sequence[str], dispatch_size: int | None) -> None:
        self._db.execute(
            "INSERT INTO dock_consumers (name, needs, produces, dispatch_size) VALUES (?, ?, ?, ?)",
            (name, json.dumps(list(needs)), json.dumps(list(produces)), dispatch_size),
        )

    def cells(self, iteration: int, name: str, rows: Sequence[int]) -> dict[int, bytes]:
        """The stored bytes of the given cells of one column (cells not written are absent)."""
        out: dict[int, bytes] = {}
        for start in range(0, len(rows), _CELLS_PER_STATEMENT):
            part = rows[start : start + _CELLS_PER_STATEMENT]
            marks = ",".join("?" * len(part))
            for row, value in self._db.execute(
                f"SELECT row, value FROM dock_cells WHERE iteration = ? AND name = ? AND row IN ({marks})",
                [iteration, name, *part],
            ):
                out[row] = value
        return out

    def write_cells(self, iteration: int, name: str, cells: Iterable[tuple[int, bytes]]) -> None:
        self._db.executemany(
            "INSERT INTO dock_cells (iteration, name, row, value) VALUES (?, ?, ?, ?)",
            ((iteration, name, row, value) for row, value in cells),
        )

    def add_lease(self, lease: Lease) -> None:
        self._db.execute(
            "INSERT INTO dock_leases (lease, consumer, iteration, rows, expires_at, state) VALUES (?, ?, ?, ?, ?, ?)",
            (
                lease.lease,
                lease.consumer,
                lease.iteration,
                lease.rows.astype("<i8").tobytes(),
                lease.expires_at,
                lease.state,
            ),
        )

    def set_lease(self, lease: str, *, state: LeaseState, expires_at: float) -> None:
        self._db.execute("UPDATE dock_leases SET state = ?, expires_at = ? WHERE lease = ?", (state, expires_at, lease))

    def mark_consumed(self, consumer: str, iteration: int, rows: Iterable[int]) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO dock_consumed (consumer, iteration, row) VALUES (?, ?, ?)",
            ((consumer, iteration, int(r)) for r in rows),
        )
