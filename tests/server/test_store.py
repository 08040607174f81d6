"""The store on its own, on SQLite (and under ``--database postgresql`` on PostgreSQL): binding, iterations, idempotent grades, what a reopen sees;
and SQLite's own (the WAL, migrations of older files)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from proctor.server.state.rows import NO_SLOT, GradeRow, IterationRow, TransitionRecord
from proctor.server.store import SCHEMA_VERSION, StateInUseError, StateMismatchError, Store, grades, redacted


def open_store(path: Path | str) -> Store:
    store = Store(path)
    store.bind(curriculum="tiny", curriculum_hash="abc", seed=1)
    return store


@pytest.fixture
def state(tmp_path: Path, state_target: Callable[[str], str]) -> str:
    """Where a store keeps its state: a SQLite file, or under ``--database postgresql`` a fresh database."""
    return state_target(str(tmp_path / "s.db"))


def grade_row(key_suffix: int, *, reward: float = 1.0, error: str | None = None, stage: int = 0) -> GradeRow:
    key = (0, f"add:0123456789:{key_suffix}", NO_SLOT, 0, "sha")
    return GradeRow(key, stage, "add", reward, {"numeric": reward}, error)


def test_a_state_file_belongs_to_one_curriculum(state: str) -> None:
    open_store(state).close()
    other = Store(state)
    with pytest.raises(StateMismatchError, match=r"belongs to curriculum 'tiny' \(hash abc, seed 1\)") as info:
        other.bind(curriculum="tiny", curriculum_hash="def", seed=1)
    assert "start a new run with another --run name or --database-url path (PROCTOR_RUN, PROCTOR_DATABASE_URL)" in str(
        info.value
    )
    with pytest.raises(StateMismatchError, match="seed 2"):
        other.bind(curriculum="tiny", curriculum_hash="abc", seed=2)
    other.bind(curriculum="tiny", curriculum_hash="abc", seed=1)
    other.close()


def test_a_state_of_a_newer_schema_is_refused_saying_so(state: str) -> None:
    store = open_store(state)
    store.connection.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    store.close()
    again = Store(state)
    with pytest.raises(StateMismatchError) as info:
        again.bind(curriculum="tiny", curriculum_hash="abc", seed=1)
    again.close()
    assert str(info.value).endswith(
        f"was written by a newer proctor (schema version 99; this one reads up to {SCHEMA_VERSION}): upgrade proctor to "
        "serve it, "
        "or start a new run with another --run or --database-url"
    )


def test_a_state_file_serves_one_store_at_a_time(state: str) -> None:
    held = open_store(state)
    with pytest.raises(StateInUseError) as info:
        Store(state)
    if state.startswith("postgresql://"):
        assert str(info.value) == (
            f"database {state} is in use by another proctor serve; a proctor serve started on it stands by for that "
            "one and takes over when it stops. One process serves a database at a time"
        )
    else:
        assert str(info.value) == (
            f"state file {state} is in use by another proctor serve; stop that one, or give this one another --run "
            "or --database-url (PROCTOR_RUN, PROCTOR_DATABASE_URL). One state file serves one process"
        )
    held.close()
    open_store(state).close()  # free again once closed


def test_iterations_and_transitions_survive_a_reopen(state: str) -> None:
    store = open_store(state)
    samples = [{"sample_id": "add:0123456789:0", "prompt": "p"}]
    transition = TransitionRecord(3, 0, 1, "gate", 0.9, 4)
    store.record_iteration(IterationRow(3, 1, 1, samples), [transition])
    store.close()
    again = open_store(state)
    assert again.get_iteration(3) == IterationRow(3, 1, 1, samples)
    assert again.get_iteration(4) is None
    assert again.transitions() == [transition]
    assert again.last_iteration() == 3
    assert again.latest_served(["add:0123456789:0", "add:0123456789:1"]) == {"add:0123456789:0": 3}
    again.close()


def test_a_duplicate_iteration_is_refused_atomically(state: str) -> None:
    store = open_store(state)
    store.record_iteration(IterationRow(0, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])
    with pytest.raises(Exception, match=r"(?i)unique"):
        store.record_iteration(
            IterationRow(0, 1, 0, [{"sample_id": "a:0123456789:0"}]), [TransitionRecord(0, 0, 1, "x")]
        )
    # The transition of the refused iteration was rolled back with it.
    assert store.transitions() == []
    with pytest.raises(Exception, match=r"(?i)unique"):
        store.record_iteration(IterationRow(0, 1, 0, [{"sample_id": "a:0123456789:9"}]), [])
    assert store.latest_served(["a:0123456789:9"]) == {}  # nor is its record indexed as served
    store.close()


def test_grade_outcomes(state: str) -> None:
    store = open_store(state)
    assert store.insert_grades([grade_row(1), grade_row(2, error="boom", reward=-1)]).outcomes == [
        "inserted",
        "inserted",
    ]
    # A success is final; an error is replaced by the next attempt.
    assert store.insert_grades([grade_row(1, reward=0.0), grade_row(2, reward=0.5)]).outcomes == [
        "exists",
        "replaced_error",
    ]
    found = store.find_grades([grade_row(1).key, grade_row(2).key, grade_row(3).key])
    assert found[grade_row(1).key].reward == 1.0
    assert found[grade_row(2).key].reward == 0.5
    assert found[grade_row(2).key].error is None
    assert grade_row(3).key not in found
    store.close()


def test_stage_totals_and_recent_rewards(state: str) -> None:
    store = open_store(state)
    store.record_iteration(IterationRow(0, 2, 0, [{"sample_id": f"a:0123456789:{i}"} for i in range(2)]), [])
    store.insert_grades([grade_row(i, reward=i / 10) for i in range(5)] + [grade_row(9, error="x", reward=-1)])
    store.close()
    again = open_store(state)
    totals = again.stage_totals()[0]
    assert (totals.iterations, totals.samples, totals.graded, totals.errors) == (1, 2, 5, 1)
    assert totals.reward_sum == pytest.approx(1.0)
    assert again.recent_rewards(0, 3) == [0.2, 0.3, 0.4]
    again.close()


def test_memory_state_is_accepted(tmp_path: Path) -> None:
    store = Store(":memory:")
    store.bind(curriculum="tiny", curriculum_hash="abc", seed=1)
    assert store.last_iteration() is None
    store.close()


def wal_frames(path: Path) -> int:
    import sqlite3

    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])
    finally:
        db.close()


def test_commits_never_checkpoint_the_service_does_and_close_folds_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    wal = Path(str(path) + "-wal")
    store = open_store(path)
    for i in range(1500):
        store.record_iteration(IterationRow(i, 1, 0, [{"sample_id": f"a:0123456789:{i}", "pad": "x" * 2000}]), [])
    # SQLite's default would have checkpointed inside the commit that crossed 1000 frames (a latency spike).
    assert wal.stat().st_size > 1000 * 4096
    store.checkpoint(restart_after_frames=0)
    store.record_iteration(IterationRow(1500, 1, 0, [{"sample_id": "a:0123456789:1500"}]), [])
    assert wal_frames(path) < 10  # everything was copied, and the next write started the WAL over
    store.close()
    assert not wal.exists() or wal.stat().st_size == 0
    again = open_store(path)
    assert again.last_iteration() == 1500
    again.close()


# The layout version 1 wrote: grades keyed without a slot, no served index.
SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE iterations (iteration INTEGER PRIMARY KEY, batch_size INTEGER NOT NULL, stage INTEGER NOT NULL,
    samples TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE transitions (seq INTEGER PRIMARY KEY, iteration INTEGER NOT NULL, from_stage INTEGER NOT NULL,
    to_stage INTEGER NOT NULL, reason TEXT NOT NULL, rolling_reward REAL, rolling_count INTEGER,
    created_at REAL NOT NULL);
CREATE TABLE grades (seq INTEGER PRIMARY KEY, iteration INTEGER NOT NULL, sample_id TEXT NOT NULL,
    completion_index INTEGER NOT NULL, completion_sha TEXT NOT NULL, stage INTEGER NOT NULL, source TEXT NOT NULL,
    reward REAL NOT NULL, components TEXT NOT NULL, error TEXT, created_at REAL NOT NULL,
    UNIQUE (iteration, sample_id, completion_index, completion_sha));
CREATE INDEX grades_by_stage ON grades (stage, seq);
INSERT INTO meta VALUES ('schema_version', '1'), ('curriculum', 'tiny'), ('curriculum_hash', 'abc'), ('seed', '1');
INSERT INTO iterations VALUES (0, 2, 0, '[{"sample_id": "add:0123456789:0"}, {"sample_id": "add:0123456789:1"}]', 0);
INSERT INTO iterations VALUES (1, 2, 0, '[{"sample_id": "add:0123456789:1"}, {"sample_id": "add:0123456789:2"}]', 0);
INSERT INTO grades VALUES (1, 0, 'add:0123456789:0', 0, 'sha', 0, 'add', 0.5, '{"numeric": 0.5}', NULL, 0);
"""


def test_a_version_1_state_file_is_migrated_in_place(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_V1)
    store = open_store(path)
    key = (0, "add:0123456789:0", NO_SLOT, 0, "sha")
    assert store.find_grades([key])[key].reward == 0.5
    assert store.latest_served(["add:0123456789:0", "add:0123456789:1", "add:0123456789:2", "add:0123456789:3"]) == {
        "add:0123456789:0": 0,
        "add:0123456789:1": 1,
        "add:0123456789:2": 1,
    }
    store.close()
    again = open_store(path)  # reopening a migrated file changes nothing
    assert again.stage_totals()[0].graded == 1
    again.close()


def test_a_version_3_state_gains_the_refills_table(state: str) -> None:
    store = open_store(state)
    store.record_iteration(IterationRow(0, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])
    store.connection.execute("DROP TABLE refills")
    store.connection.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    store.close()
    again = open_store(state)  # binds, so its version is this proctor's again
    detail = {"rule": "zero_variance", "group_size": 2, "groups": 1, "replaced": [[0, 0, 1]]}
    samples = '[{"sample_id": "a:0123456789:0", "slot": 0}, {"sample_id": "a:0123456789:5", "slot": 1}]'
    again.record_refill(0, 1, detail, samples, ["a:0123456789:5"])
    assert again.refills(0) == [(1, detail)]
    row = again.get_iteration(0)
    assert row is not None and [s["sample_id"] for s in row.samples] == ["a:0123456789:0", "a:0123456789:5"]
    assert again.latest_served(["a:0123456789:5"]) == {"a:0123456789:5": 0}
    assert again.refill_counts(0) == {0: (1, 1)}
    again.close()


def test_a_version_4_state_gains_the_graders_details(state: str) -> None:
    store = open_store(state)
    before = GradeRow((0, "add:0123456789:0", 0, 0, "sha"), 0, "add", 1.0, {"numeric": 1.0}, None)
    store.insert_grades([before])
    store.connection.execute("ALTER TABLE grades DROP COLUMN details")
    store.connection.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    store.close()
    again = open_store(state)
    assert again.find_grades([before.key])[before.key].details == {}  # version 4 kept none
    detail = {"code": {"tests": ["pass", "timeout"], "failure": None}}
    row = GradeRow((0, "add:0123456789:1", 1, 0, "sha"), 0, "add", 0.5, {"code": 0.5}, None, detail)
    again.insert_grades([row])
    assert again.find_grades([row.key])[row.key] == row
    again.close()


def test_a_grade_is_keyed_by_its_slot(state: str) -> None:
    store = open_store(state)
    one = grade_row(1)  # no slot
    other = GradeRow((0, "add:0123456789:1", 5, 0, "sha"), 0, "add", 0.0, {}, None)
    assert store.insert_grades([one, other]).outcomes == ["inserted", "inserted"]
    assert store.find_grades([other.key])[other.key].reward == 0.0
    assert store.graded_iterations([0, 1, 5]) == {0}
    store.close()


def test_graded_iterations_counts_grades_stored_before_and_since_the_store_opened(state: str) -> None:
    def graded_at(iteration: int, suffix: int, *, error: str | None = None) -> GradeRow:
        return GradeRow((iteration, f"add:0123456789:{suffix}", 0, 0, "sha"), 0, "add", 1.0, {}, error)

    store = open_store(state)
    store.insert_grades([graded_at(3, 1), graded_at(7, 2, error="timeout")])
    store.close()
    store = open_store(state)
    assert store.graded_iterations(range(12)) == {3, 7}
    store.insert_grades([graded_at(5, 3), graded_at(9, 4, error="timeout"), graded_at(3, 5)])
    assert store.graded_iterations(range(12)) == {3, 5, 7, 9}
    assert store.graded_iterations([]) == set()
    store.close()
    store = open_store(state)
    assert store.graded_iterations(range(12)) == {3, 5, 7, 9}
    store.close()


def test_graded_iterations_stay_right_past_what_memory_keeps(state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grades, "GRADED_KEPT", 4)  # a long run's worth, in a few iterations
    store = open_store(state)
    graded: set[int] = set()
    for iteration in range(0, 40, 3):
        store.insert_grades([GradeRow((iteration, "add:0123456789:1", 0, 0, "sha"), 0, "add", 1.0, {}, None)])
        graded.add(iteration)
        assert store.graded_iterations(range(45)) == graded
    store.close()


def test_the_served_index_keeps_the_latest_iteration(state: str) -> None:
    store = open_store(state)
    store.record_iteration(IterationRow(7, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])
    store.record_iteration(IterationRow(3, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])  # an earlier gap filled
    assert store.latest_served(["a:0123456789:0"]) == {"a:0123456789:0": 7}
    store.close()


def test_the_served_index_answers_for_ids_not_yet_written_to_it(state: str) -> None:
    store = open_store(state)
    store.served_index_every_s = math.inf
    store.record_iteration(
        IterationRow(4, 2, 0, [{"sample_id": "a:0123456789:0"}, {"sample_id": "a:0123456789:1"}]), []
    )
    store.record_iteration(IterationRow(5, 1, 0, [{"sample_id": "a:0123456789:1"}]), [])
    assert store.connection.execute("SELECT COUNT(*) FROM served").fetchone()[0] == 0
    assert store.latest_served(["a:0123456789:0", "a:0123456789:1"]) == {"a:0123456789:0": 4, "a:0123456789:1": 5}
    store.record_iteration(IterationRow(2, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])  # a gap filled late
    assert store.latest_served(["a:0123456789:0", "a:0123456789:1"]) == {"a:0123456789:0": 4, "a:0123456789:1": 5}
    store.close()  # writes them
    again = open_store(state)
    assert again.connection.execute("SELECT COUNT(*) FROM served").fetchone()[0] == 2
    # and no mark of held ids is left for the next open
    assert {k for (k,) in again.connection.execute("SELECT key FROM meta")} == {
        "created_at",
        "curriculum",
        "curriculum_hash",
        "schema_version",
        "seed",
    }
    assert again.latest_served(["a:0123456789:0", "a:0123456789:1"]) == {"a:0123456789:0": 4, "a:0123456789:1": 5}
    again.close()


def test_an_iteration_below_one_recorded_is_indexed_at_once(state: str) -> None:
    # Held ids are marked by their lowest iteration, which a restart after a crash indexes again from; an
    # iteration recorded late below the others must not move that mark back over every iteration since.
    store = open_store(state)
    store.served_index_every_s = math.inf
    store.record_iteration(IterationRow(1_000, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])
    store.record_iteration(
        IterationRow(5, 2, 0, [{"sample_id": "a:0123456789:0"}, {"sample_id": "a:0123456789:1"}]), []
    )
    assert dict(store.connection.execute("SELECT sample_id, iteration FROM served").fetchall()) == {
        "a:0123456789:0": 5,
        "a:0123456789:1": 5,
    }
    mark = store.connection.execute("SELECT value FROM meta WHERE key = 'served_pending_from'").fetchone()
    assert mark == ("1000",)
    assert store.latest_served(["a:0123456789:0", "a:0123456789:1"]) == {"a:0123456789:0": 1_000, "a:0123456789:1": 5}
    store.close()


def test_the_served_index_of_a_killed_server_is_written_when_the_state_opens(state: str) -> None:
    # The child records iterations and dies without closing: the ids it held in memory were never written to the
    # index. One step is indexed (every_s 0), then two are held, one of them earlier than the indexed one.
    code = f"""
import math, os
from proctor.server.state.rows import IterationRow
from proctor.server.store import Store
store = Store({state!r})
store.bind(curriculum="tiny", curriculum_hash="abc", seed=1)
store.served_index_every_s = 0
store.record_iteration(IterationRow(5, 2, 0, [{{"sample_id": "a:0123456789:0"}}, {{"sample_id": "a:0123456789:1"}}]), [])
store.served_index_every_s = math.inf
store.record_iteration(IterationRow(7, 1, 0, [{{"sample_id": "a:0123456789:1"}}]), [])
store.record_iteration(IterationRow(3, 2, 0, [{{"sample_id": "a:0123456789:0"}}, {{"sample_id": "a:0123456789:2"}}]), [])
os._exit(0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    again = open_store(state)
    ids = ["a:0123456789:0", "a:0123456789:1", "a:0123456789:2", "a:0123456789:3"]
    expected = {"a:0123456789:0": 5, "a:0123456789:1": 7, "a:0123456789:2": 3}
    assert again.latest_served(ids) == expected
    assert dict(again.connection.execute("SELECT sample_id, iteration FROM served").fetchall()) == expected
    again.close()


def test_closing_while_a_checkpoint_runs_waits_for_it(tmp_path: Path) -> None:
    # Run in a child process: closing the checkpoint connection under a running checkpoint crashes the
    # interpreter (SIGSEGV) rather than raising.
    code = f"""
import threading
from proctor.server.store import Store
for n in range(200):
    store = Store({str(tmp_path)!r} + f"/state-{{n}}.db")
    store.bind(curriculum="c", curriculum_hash="h", seed=1)
    started = threading.Event()
    def hammer() -> None:
        started.set()
        for _ in range(50):
            store.checkpoint(restart_after_frames=0)
    thread = threading.Thread(target=hammer)
    thread.start()
    started.wait()
    store.close()
    thread.join()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_a_database_url_is_shown_without_its_password() -> None:
    assert redacted("postgresql://proctor:s3cret@db:5432/runs") == "postgresql://proctor:***@db:5432/runs"
    assert redacted("postgresql://proctor@db/runs") == "postgresql://proctor@db/runs"
    assert redacted("/srv/state.db") == "/srv/state.db"


def test_rewards_keep_double_precision(state: str) -> None:
    store = open_store(state)
    reward = 0.1 + 2**-40
    store.insert_grades([grade_row(1, reward=reward)])
    assert store.find_grades([grade_row(1).key])[grade_row(1).key].reward == reward
    store.close()


def test_a_state_beyond_32_bits(state: str) -> None:
    store = open_store(state)
    big = 2**53 - 1
    store.record_iteration(IterationRow(big, 1, 0, [{"sample_id": "a:0123456789:0"}]), [])
    assert store.last_iteration() == big
    assert store.latest_served(["a:0123456789:0"]) == {"a:0123456789:0": big}
    store.close()
