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

from proctor.experience import (
    CellConflictError,
    Consumption,
    ExperienceInputError,
    ExperienceStore,
    LeaseError,
    RowKey,
    UnknownIterationError,
)


@contextmanager
def opened(path: Path | str, keep_iterations: int = 8) -> Iterator[ExperienceStore]:
    store = ExperienceStore(path, keep_iterations=keep_iterations)
    try:
        yield store
    finally:
        store.close()


def all_rows(slots: int, group_size: int) -> list[RowKey]:
    return [(s, k) for s in range(slots) for k in range(group_size)]


def state(experience: ExperienceStore) -> tuple[object, ...]:
    tables = [(t.iteration, t.slots, t.group_size, dict(t.written)) for t in experience.tables()]
    consumption: list[Consumption] = [
        experience.consumption(c.name, t.iteration) for c in experience.consumers() for t in experience.tables()
    ]
    return (tables, experience.consumers(), consumption)


def test_reopening_the_file_gives_the_same_state_with_a_lease_still_held(experience_path: Path) -> None:
    ids = [np.arange(n, dtype=np.int32) for n in range(1, 5)]
    with opened(experience_path) as experience:
        experience.open(0, slots=2, group_size=2)
        experience.open(1, slots=1, group_size=3)
        experience.register("scorer", needs=["prompt", "ids"], produces=["score"], dispatch_size=2)
        experience.register("critic", needs=["prompt"])
        experience.put(0, all_rows(2, 2), {"prompt": ["a", "b", "c", "d"], "ids": ids})
        experience.put(1, [(0, 2)], {"prompt": ["later"]})
        done = experience.dispatch("scorer", 2, iteration=0)
        assert done.lease is not None
        experience.collect(done.lease, {"score": [0.5, 1.0]})
        held = experience.dispatch("scorer", 1, iteration=0, lease_s=60.0)
        assert held.lease is not None
        before = state(experience)
        assert experience.consumption("scorer", 0) == Consumption("scorer", 0, 4, 2, 1, 1)

    with opened(experience_path) as experience:
        assert state(experience) == before
        assert experience.read(0, list(done.rows), ["score"]) == {"score": [0.5, 1.0]}
        got = experience.read(0, all_rows(2, 2), ["ids"])["ids"]
        assert all(g.dtype == np.int32 and np.array_equal(g, i) for g, i in zip(got, ids, strict=True))
        # The held row is not handed out again until its lease ends; the one free row is.
        free = experience.dispatch("scorer", 4, iteration=0)
        assert free.lease is not None
        assert set(free.rows).isdisjoint(held.rows) and len(free) == 1
        experience.collect(held.lease, {"score": [0.0]})
        experience.collect(free.lease, {"score": [0.25]})
        assert experience.all_consumed("scorer", 0)
        # A collected lease is still known: the same values again are a no-op, others a conflict.
        experience.collect(done.lease, {"score": [0.5, 1.0]})
        with pytest.raises(CellConflictError, match="column 'score' of row"):
            experience.collect(done.lease, {"score": [0.5, 0.0]})
        with pytest.raises(CellConflictError, match=re.escape(f"column 'score' of row {held.rows[0]}")):
            experience.put(0, [held.rows[0]], {"score": [1.0]})
        assert len(experience.dispatch("critic", iteration=0, count=4)) == 4

    with opened(experience_path) as experience:
        assert experience.all_consumed("scorer", 0)
        assert experience.consumption("critic", 0) == Consumption("critic", 0, 4, 0, 4, 0)
        assert dict(experience.table(0).written) == {"ids": 4, "prompt": 4, "score": 4}


def test_a_lease_that_ends_while_the_store_is_closed_is_expired_on_reopening(experience_path: Path) -> None:
    with opened(experience_path) as experience:
        experience.open(0, slots=1, group_size=2)
        experience.register("scorer", needs=["prompt"], produces=["score"])
        experience.put(0, all_rows(1, 2), {"prompt": ["a", "b"]})
        late = experience.dispatch("scorer", 2, lease_s=0.3)
        assert late.lease is not None
    time.sleep(0.45)
    with opened(experience_path) as experience:
        assert experience.consumption("scorer", 0) == Consumption("scorer", 0, 2, 0, 0, 2)
        with pytest.raises(LeaseError, match="expired"):
            experience.collect(late.lease, {"score": [1.0, 1.0]})
        assert experience.dispatch("scorer", 2).rows == late.rows


def test_a_renewal_survives_reopening(experience_path: Path) -> None:
    with opened(experience_path) as experience:
        experience.open(0, slots=1, group_size=1)
        experience.register("scorer", needs=["prompt"], produces=["score"])
        experience.put(0, [(0, 0)], {"prompt": ["a"]})
        batch = experience.dispatch("scorer", 1, lease_s=0.3)
        assert batch.lease is not None
        experience.renew(batch.lease, 60.0)
    time.sleep(0.45)
    with opened(experience_path) as experience:
        assert experience.consumption("scorer", 0).held == 1
        experience.collect(batch.lease, {"score": [1.0]})
        assert experience.all_consumed("scorer", 0)


def test_retention_keeps_the_last_keep_iterations_tables(experience_path: Path) -> None:
    with opened(experience_path, keep_iterations=2) as experience:
        experience.register("scorer", needs=["prompt"], produces=["score"])
        for iteration in range(2):
            experience.open(iteration, slots=1, group_size=2)
            experience.put(iteration, all_rows(1, 2), {"prompt": ["a", "b"]})
        old = experience.dispatch("scorer", 2, iteration=0)
        assert old.lease is not None
        experience.open(2, slots=1, group_size=2)
        assert [t.iteration for t in experience.tables()] == [1, 2]
        for call in (
            lambda: experience.table(0),
            lambda: experience.put(0, [(0, 0)], {"prompt": ["a"]}),
            lambda: experience.read(0, [(0, 0)], ["prompt"]),
            lambda: experience.dispatch("scorer", 1, iteration=0),
            lambda: experience.consumption("scorer", 0),
        ):
            with pytest.raises(UnknownIterationError, match=r"iteration 0 has no table \(kept: 1\.\.2\)"):
                call()
        with pytest.raises(UnknownIterationError, match="iteration 0 is older than every table kept"):
            experience.open(0, slots=1, group_size=2)
        with pytest.raises(LeaseError, match="is unknown"):
            experience.collect(old.lease, {"score": [1.0, 1.0]})
        assert experience.dispatch("scorer", 2).iteration == 1

    with opened(experience_path, keep_iterations=2) as experience:
        assert [t.iteration for t in experience.tables()] == [1, 2]
        assert dict(experience.table(1).written) == {"prompt": 2}
        assert experience.consumption("scorer", 1).held == 2
        with pytest.raises(UnknownIterationError, match="iteration 0 has no table"):
            experience.table(0)
        experience.open(3, slots=1, group_size=1)
        assert [t.iteration for t in experience.tables()] == [2, 3]


def test_retention_accepts_an_older_table_while_there_is_room(experience_path: Path) -> None:
    with opened(experience_path, keep_iterations=2) as experience:
        experience.open(5, slots=1, group_size=1)
        experience.open(3, slots=1, group_size=1)
        assert [t.iteration for t in experience.tables()] == [3, 5]
        with pytest.raises(UnknownIterationError, match="iteration 1 is older than every table kept"):
            experience.open(1, slots=1, group_size=1)
        experience.open(4, slots=1, group_size=1)
        assert [t.iteration for t in experience.tables()] == [4, 5]


def test_keep_iterations_below_one_is_refused(experience_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_iterations must be at least 1"):
        ExperienceStore(experience_path, keep_iterations=0)


@pytest.mark.parametrize("path", [":memory:", None], ids=["memory", "default"])
def test_a_store_in_memory_works(path: str | None) -> None:
    experience = ExperienceStore() if path is None else ExperienceStore(path)
    try:
        experience.open(0, slots=2, group_size=1)
        experience.register("scorer", needs=["prompt"], produces=["score"])
        experience.put(0, all_rows(2, 1), {"prompt": ["a", "b"]})
        batch = experience.dispatch("scorer", 2)
        assert batch.lease is not None
        experience.collect(batch.lease, {"score": [1.0, 0.0]})
        assert experience.all_consumed("scorer", 0)
        assert experience.read(0, all_rows(2, 1), ["score"]) == {"score": [1.0, 0.0]}
    finally:
        experience.close()


def test_two_stores_in_memory_are_separate() -> None:
    with opened(":memory:") as one, opened(":memory:") as two:
        one.open(0, slots=1, group_size=1)
        assert two.tables() == []


# --- known bugs of the in-process face (strict: each turns into a failure once fixed, to be unmarked) -----------


def test_a_row_key_that_is_not_integers_is_refused(experience_path: Path) -> None:
    with opened(experience_path) as experience:
        experience.open(0, slots=2, group_size=2)
        with pytest.raises(ExperienceInputError, match=r"^rows\[0\]: "):
            experience.put(0, [(0.5, 0)], {"x": [1]})  # type: ignore[list-item]


def test_needs_given_as_one_string_is_refused(experience_path: Path) -> None:
    with opened(experience_path) as experience, pytest.raises(ExperienceInputError, match=r"^needs"):
        experience.register("scorer", needs="prompt")


def test_written_lists_only_columns_with_cells_and_is_the_same_after_reopening(experience_path: Path) -> None:
    with opened(experience_path) as experience:
        experience.open(0, slots=1, group_size=1)
        experience.register("scorer", needs=["response"])
        experience.put(0, [(0, 0)], {"prompt": ["a"]})
        experience.dispatch("scorer", 1)
        before = dict(experience.table(0).written)
    with opened(experience_path) as experience:
        assert dict(experience.table(0).written) == before == {"prompt": 1}


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


def test_a_file_of_the_per_cell_layout_is_moved_to_chunks_with_its_cells_and_leases(experience_path: Path) -> None:
    import sqlite3

    from proctor.experience.values import encode_cell

    db = sqlite3.connect(experience_path)
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

    with opened(experience_path) as experience:
        assert experience.read(3, all_rows(2, 2), ["completion"])["completion"] == texts
        assert experience.read(3, all_rows(2, 2), ["reward"], missing="none")["reward"] == [None, 1.0, None, None]
        c = experience.consumption("grader", 3)
        assert (c.rows, c.consumed, c.held, c.ready) == (4, 1, 1, 2)
        assert experience.collect("live", {"reward": [0.0]}).rows == ((1, 0),)
    db = sqlite3.connect(experience_path)
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    db.close()
    assert names == {"experience_tables", "experience_chunks", "experience_consumers", "experience_leases"}


def test_a_file_whose_tables_have_their_former_names_opens_with_everything_in_it(experience_path: Path) -> None:
    import sqlite3

    with opened(experience_path) as experience:
        experience.open(0, slots=1, group_size=2)
        experience.register("scorer", needs=["prompt"], produces=["score"])
        experience.put(0, [(0, 0), (0, 1)], {"prompt": ["a", "b"]})
        lease = experience.dispatch("scorer", 1).lease
    db = sqlite3.connect(experience_path)
    for name in ("tables", "chunks", "consumers", "leases"):
        db.execute(f"ALTER TABLE experience_{name} RENAME TO dock_{name}")
    for name in ("chunks", "leases"):
        db.execute(f"DROP INDEX experience_{name}_by_iteration")
        db.execute(f"CREATE INDEX dock_{name}_by_iteration ON dock_{name} (iteration)")
    db.commit()
    db.close()

    with opened(experience_path) as experience:
        assert experience.read(0, [(0, 0), (0, 1)], ["prompt"])["prompt"] == ["a", "b"]
        assert lease is not None and experience.collect(lease, {"score": [1.0]}).rows == ((0, 0),)
    db = sqlite3.connect(experience_path)
    names = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
    db.close()
    assert not {n for n in names if n.startswith("dock_")}
