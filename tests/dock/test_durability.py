"""What only the in-process store shows: the same SQLite file opened again holds the same state (tables, cells,
consumers, consumption, leases), retention, a store in memory, and input checks the HTTP face does not reach."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from proctor.dock import (
    CellConflictError,
    Consumption,
    DockInputError,
    LeaseError,
    RowKey,
    TransferDock,
    UnknownIterationError,
)


@contextmanager
def opened(path: Path | str, keep_iterations: int = 8) -> Iterator[TransferDock]:
    store = TransferDock(path, keep_iterations=keep_iterations)
    try:
        yield store
    finally:
        store.close()


def all_rows(slots: int, group_size: int) -> list[RowKey]:
    return [(s, k) for s in range(slots) for k in range(group_size)]


def state(dock: TransferDock) -> tuple[object, ...]:
    tables = [(t.iteration, t.slots, t.group_size, dict(t.written)) for t in dock.tables()]
    consumption: list[Consumption] = [
        dock.consumption(c.name, t.iteration) for c in dock.consumers() for t in dock.tables()
    ]
    return (tables, dock.consumers(), consumption)


def test_reopening_the_file_gives_the_same_state_with_a_lease_still_held(dock_path: Path) -> None:
    ids = [np.arange(n, dtype=np.int32) for n in range(1, 5)]
    with opened(dock_path) as dock:
        dock.open(0, slots=2, group_size=2)
        dock.open(1, slots=1, group_size=3)
        dock.register("scorer", needs=["prompt", "ids"], produces=["score"], dispatch_size=2)
        dock.register("critic", needs=["prompt"])
        dock.put(0, all_rows(2, 2), {"prompt": ["a", "b", "c", "d"], "ids": ids})
        dock.put(1, [(0, 2)], {"prompt": ["later"]})
        done = dock.dispatch("scorer", 2, iteration=0)
        assert done.lease is not None
        dock.collect(done.lease, {"score": [0.5, 1.0]})
        held = dock.dispatch("scorer", 1, iteration=0, lease_s=60.0)
        assert held.lease is not None
        before = state(dock)
        assert dock.consumption("scorer", 0) == Consumption("scorer", 0, 4, 2, 1, 1)

    with opened(dock_path) as dock:
        assert state(dock) == before
        assert dock.read(0, list(done.rows), ["score"]) == {"score": [0.5, 1.0]}
        got = dock.read(0, all_rows(2, 2), ["ids"])["ids"]
        assert all(g.dtype == np.int32 and np.array_equal(g, i) for g, i in zip(got, ids, strict=True))
        # The held row is not handed out again until its lease ends; the one free row is.
        free = dock.dispatch("scorer", 4, iteration=0)
        assert free.lease is not None
        assert set(free.rows).isdisjoint(held.rows) and len(free) == 1
        dock.collect(held.lease, {"score": [0.0]})
        dock.collect(free.lease, {"score": [0.25]})
        assert dock.all_consumed("scorer", 0)
        # A collected lease is still known: the same values again are a no-op, others a conflict.
        dock.collect(done.lease, {"score": [0.5, 1.0]})
        with pytest.raises(CellConflictError, match="column 'score' of row"):
            dock.collect(done.lease, {"score": [0.5, 0.0]})
        with pytest.raises(CellConflictError, match=re.escape(f"column 'score' of row {held.rows[0]}")):
            dock.put(0, [held.rows[0]], {"score": [1.0]})
        assert len(dock.dispatch("critic", iteration=0, count=4)) == 4

    with opened(dock_path) as dock:
        assert dock.all_consumed("scorer", 0)
        assert dock.consumption("critic", 0) == Consumption("critic", 0, 4, 0, 4, 0)
        assert dict(dock.table(0).written) == {"ids": 4, "prompt": 4, "score": 4}


def test_a_lease_that_ends_while_the_store_is_closed_is_expired_on_reopening(dock_path: Path) -> None:
    with opened(dock_path) as dock:
        dock.open(0, slots=1, group_size=2)
        dock.register("scorer", needs=["prompt"], produces=["score"])
        dock.put(0, all_rows(1, 2), {"prompt": ["a", "b"]})
        late = dock.dispatch("scorer", 2, lease_s=0.3)
        assert late.lease is not None
    time.sleep(0.45)
    with opened(dock_path) as dock:
        assert dock.consumption("scorer", 0) == Consumption("scorer", 0, 2, 0, 0, 2)
        with pytest.raises(LeaseError, match="expired"):
            dock.collect(late.lease, {"score": [1.0, 1.0]})
        assert dock.dispatch("scorer", 2).rows == late.rows


def test_a_renewal_survives_reopening(dock_path: Path) -> None:
    with opened(dock_path) as dock:
        dock.open(0, slots=1, group_size=1)
        dock.register("scorer", needs=["prompt"], produces=["score"])
        dock.put(0, [(0, 0)], {"prompt": ["a"]})
        batch = dock.dispatch("scorer", 1, lease_s=0.3)
        assert batch.lease is not None
        dock.renew(batch.lease, 60.0)
    time.sleep(0.45)
    with opened(dock_path) as dock:
        assert dock.consumption("scorer", 0).held == 1
        dock.collect(batch.lease, {"score": [1.0]})
        assert dock.all_consumed("scorer", 0)


def test_retention_keeps_the_last_keep_iterations_tables(dock_path: Path) -> None:
    with opened(dock_path, keep_iterations=2) as dock:
        dock.register("scorer", needs=["prompt"], produces=["score"])
        for iteration in range(2):
            dock.open(iteration, slots=1, group_size=2)
            dock.put(iteration, all_rows(1, 2), {"prompt": ["a", "b"]})
        old = dock.dispatch("scorer", 2, iteration=0)
        assert old.lease is not None
        dock.open(2, slots=1, group_size=2)
        assert [t.iteration for t in dock.tables()] == [1, 2]
        for call in (
            lambda: dock.table(0),
            lambda: dock.put(0, [(0, 0)], {"prompt": ["a"]}),
            lambda: dock.read(0, [(0, 0)], ["prompt"]),
            lambda: dock.dispatch("scorer", 1, iteration=0),
            lambda: dock.consumption("scorer", 0),
        ):
            with pytest.raises(UnknownIterationError, match=r"iteration 0 has no table \(kept: 1\.\.2\)"):
                call()
        with pytest.raises(UnknownIterationError, match="iteration 0 is older than every table kept"):
            dock.open(0, slots=1, group_size=2)
        with pytest.raises(LeaseError, match="is unknown"):
            dock.collect(old.lease, {"score": [1.0, 1.0]})
        assert dock.dispatch("scorer", 2).iteration == 1

    with opened(dock_path, keep_iterations=2) as dock:
        assert [t.iteration for t in dock.tables()] == [1, 2]
        assert dict(dock.table(1).written) == {"prompt": 2}
        assert dock.consumption("scorer", 1).held == 2
        with pytest.raises(UnknownIterationError, match="iteration 0 has no table"):
            dock.table(0)
        dock.open(3, slots=1, group_size=1)
        assert [t.iteration for t in dock.tables()] == [2, 3]


def test_retention_accepts_an_older_table_while_there_is_room(dock_path: Path) -> None:
    with opened(dock_path, keep_iterations=2) as dock:
        dock.open(5, slots=1, group_size=1)
        dock.open(3, slots=1, group_size=1)
        assert [t.iteration for t in dock.tables()] == [3, 5]
        with pytest.raises(UnknownIterationError, match="iteration 1 is older than every table kept"):
            dock.open(1, slots=1, group_size=1)
        dock.open(4, slots=1, group_size=1)
        assert [t.iteration for t in dock.tables()] == [4, 5]


def test_keep_iterations_below_one_is_refused(dock_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_iterations must be at least 1"):
        TransferDock(dock_path, keep_iterations=0)


@pytest.mark.parametrize("path", [":memory:", None], ids=["memory", "default"])
def test_a_store_in_memory_works(path: str | None) -> None:
    dock = TransferDock() if path is None else TransferDock(path)
    try:
        dock.open(0, slots=2, group_size=1)
        dock.register("scorer", needs=["prompt"], produces=["score"])
        dock.put(0, all_rows(2, 1), {"prompt": ["a", "b"]})
        batch = dock.dispatch("scorer", 2)
        assert batch.lease is not None
        dock.collect(batch.lease, {"score": [1.0, 0.0]})
        assert dock.all_consumed("scorer", 0)
        assert dock.read(0, all_rows(2, 1), ["score"]) == {"score": [1.0, 0.0]}
    finally:
        dock.close()


def test_two_stores_in_memory_are_separate() -> None:
    with opened(":memory:") as one, opened(":memory:") as two:
        one.open(0, slots=1, group_size=1)
        assert two.tables() == []


# --- known bugs of the in-process face (strict: each turns into a failure once fixed, to be unmarked) -----------


def test_a_row_key_that_is_not_integers_is_refused(dock_path: Path) -> None:
    with opened(dock_path) as dock:
        dock.open(0, slots=2, group_size=2)
        with pytest.raises(DockInputError, match=r"^rows\[0\]: "):
            dock.put(0, [(0.5, 0)], {"x": [1]})  # type: ignore[list-item]


def test_needs_given_as_one_string_is_refused(dock_path: Path) -> None:
    with opened(dock_path) as dock, pytest.raises(DockInputError, match=r"^needs"):
        dock.register("scorer", needs="prompt")


def test_written_lists_only_columns_with_cells_and_is_the_same_after_reopening(dock_path: Path) -> None:
    with opened(dock_path) as dock:
        dock.open(0, slots=1, group_size=1)
        dock.register("scorer", needs=["response"])
        dock.put(0, [(0, 0)], {"prompt": ["a"]})
        dock.dispatch("scorer", 1)
        before = dict(dock.table(0).written)
    with opened(dock_path) as dock:
        assert dict(dock.table(0).written) == before == {"prompt": 1}


# The layout before column chunks: a SQL row per cell (rows numbered slot × group_size + index) and per
# consumed row, a lease's rows as one int64 blob.
CELL_LAYOUT = """
CREATE TABLE dock_tables (iteration INTEGER PRIMARY KEY, slots INTEGER NOT NULL, group_size INTEGER NOT NULL,
                          created_at REAL NOT NULL);
CREATE TABLE dock_cells (id INTEGER PRIMARY KEY, iteration INTEGER NOT NULL, name TEXT NOT NULL,
                         row INTEGER NOT NULL, value BLOB NOT NULL, UNIQUE (iteration, name, row));
CREATE TABLE dock_consumers (name TEXT PRIMARY KEY, needs TEXT NOT NULL, produces TEXT NOT NULL, dispatch_size INTEGER);
CREATE TABLE dock_leases (lease TEXT PRIMARY KEY, consumer TEXT NOT NULL, iteration INTEGER NOT NULL,
                          rows BLOB NOT NULL, expires_at REAL NOT NULL, state TEXT NOT NULL);
CREATE TABLE dock_consumed (consumer TEXT NOT NULL, iteration INTEGER NOT NULL, row INTEGER NOT NULL,
                            PRIMARY KEY (consumer, iteration, row)) WITHOUT ROWID;
"""


def test_a_file_of_the_per_cell_layout_is_moved_to_chunks_with_its_cells_and_leases(dock_path: Path) -> None:
    import sqlite3

    from proctor.dock.values import encode_cell

    db = sqlite3.connect(dock_path)
    db.executescript(CELL_LAYOUT)
    db.execute("INSERT INTO dock_tables VALUES (3, 2, 2, 0)")
    texts = ["a", "b", "c", "d"]  # rows 0..3: (0, 0), (0, 1), (1, 0), (1, 1)
    db.executemany(
        "INSERT INTO dock_cells (iteration, name, row, value) VALUES (3, 'completion', ?, ?)",
        [(row, encode_cell("c", t)) for row, t in enumerate(texts)],
    )
    db.execute(
        "INSERT INTO dock_cells (iteration, name, row, value) VALUES (3, 'reward', 1, ?)", (encode_cell("r", 1.0),)
    )
    db.execute("""INSERT INTO dock_consumers VALUES ('grader', '["completion"]', '["reward"]', NULL)""")
    rows = np.array([1], dtype="<i8").tobytes()
    db.execute("INSERT INTO dock_leases VALUES ('done', 'grader', 3, ?, 0, 'collected')", (rows,))
    held = np.array([2], dtype="<i8").tobytes()
    db.execute("INSERT INTO dock_leases VALUES ('live', 'grader', 3, ?, ?, 'held')", (held, time.time() + 600))
    db.execute("INSERT INTO dock_consumed VALUES ('grader', 3, 1)")
    db.commit()
    db.close()

    with opened(dock_path) as dock:
        assert dock.read(3, all_rows(2, 2), ["completion"])["completion"] == texts
        assert dock.read(3, all_rows(2, 2), ["reward"], missing="none")["reward"] == [None, 1.0, None, None]
        c = dock.consumption("grader", 3)
        assert (c.rows, c.consumed, c.held, c.ready) == (4, 1, 1, 2)
        assert dock.collect("live", {"reward": [0.0]}).rows == ((1, 0),)
    db = sqlite3.connect(dock_path)
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    db.close()
    assert names == {"dock_tables", "dock_chunks", "dock_consumers", "dock_leases"}
