"""Durable state in one SQLite file, or one PostgreSQL database: the batch of every sampled iteration, every
grade, every transition. The statements are the same for both (:mod:`proctor.experience.database`); what follows
about the WAL, checkpoints and the file lock is SQLite's, and a PostgreSQL database is held by an advisory lock
(other servers of the database stand by meanwhile: :class:`Standby`).

WAL mode: readers never block the writer, and a transaction is on disk (in the WAL) once ``commit``
returns, so ``kill -9`` at any moment loses nothing that was acknowledged. ``synchronous=NORMAL`` (the
default here) survives a process crash; ``full`` also survives a power cut, at the cost of an fsync per
commit.

A state file belongs to one curriculum (its content hash and seed): opening it with another is refused,
since its iterations and grades would no longer mean what they meant.

All methods are synchronous. Writes go through one connection, which the experience store shares (its tables
live in the same file), so that a grade, its record's statistics and the store's cells are one transaction;
:class:`proctor.server.storage.AsyncStore` makes every write on one thread. The look-ups a request makes read
through a second connection, from the event loop, beside the writes. Checkpoints use a connection of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from proctor.experience.database import Database, is_postgresql
from proctor.server.exceptions import ProctorError
from proctor.server.state.items import NEW_GROUP, ZERO_VARIANCE, GroupState, ItemState, ItemTracking, fold_grade
from proctor.server.state.rows import (
    DecisionRow,
    GradeKey,
    GradeOutcome,
    GradeRow,
    GroupChange,
    IterationRow,
    IterationTotals,
    StageTotals,
    StoredGrades,
    TransitionRecord,
)

__all__ = [
    "Holder",
    "SQLiteVersionError",
    "Standby",
    "StateInUseError",
    "StateMismatchError",
    "StateUnreachableError",
    "Store",
    "redacted",
]

SCHEMA_VERSION = 3
T = TypeVar("T")

# Rows and keys per statement: far below SQLite's limit of 32,766 bound values.
_ROWS_PER_STATEMENT = 256
_KEYS_PER_STATEMENT = 512
# Per group of grades: the error-free ones, the errors, the error-free rewards' sum.
_GRADE_SUMS = (
    "SUM(CASE WHEN error IS NULL THEN 1 ELSE 0 END), SUM(CASE WHEN error IS NULL THEN 0 ELSE 1 END),"
    " SUM(CASE WHEN error IS NULL THEN reward END)"
)
# The PostgreSQL types of the keys that statements take sets of (see Database.rows).
_GRADE_KEY = ("bigint", "text", "bigint", "bigint", "text")  # iteration, sample_id, slot, completion_index, sha
_GROUP_KEY = ("bigint", "text", "bigint")  # iteration, sample_id, slot
_RECORD_KEY = ("text", "bigint")  # source, key
# The advisory lock a server holds on its PostgreSQL database (any number: the database is proctor's).
_ADVISORY_KEY = 0x70726F63746F72
_LOCK_WAIT_S = 1.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS iterations (
    iteration INTEGER PRIMARY KEY,
    batch_size INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    samples TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    from_stage INTEGER NOT NULL,
    to_stage INTEGER NOT NULL,
    reason TEXT NOT NULL,
    rolling_reward REAL,
    rolling_count INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS grades (
    seq INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    sample_id TEXT NOT NULL,
    slot INTEGER NOT NULL,
    completion_index INTEGER NOT NULL,
    completion_sha TEXT NOT NULL,
    stage INTEGER NOT NULL,
    source TEXT NOT NULL,
    reward REAL NOT NULL,
    components TEXT NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    UNIQUE (iteration, sample_id, slot, completion_index, completion_sha)
);
CREATE INDEX IF NOT EXISTS grades_by_stage ON grades (stage, seq);
-- The latest iteration that served each sample id: /grade without `iteration` attributes by it.
CREATE TABLE IF NOT EXISTS served (
    sample_id TEXT PRIMARY KEY,
    iteration INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS grades_errors ON grades (seq) WHERE error IS NOT NULL;
-- Per-record state of the finite sources (proctor.server.state.items), folded in with the grades.
CREATE TABLE IF NOT EXISTS items (
    source TEXT NOT NULL,
    key INTEGER NOT NULL,
    passes REAL NOT NULL DEFAULT 0,
    fails REAL NOT NULL DEFAULT 0,
    groups INTEGER NOT NULL DEFAULT 0,
    streak INTEGER NOT NULL DEFAULT 0,
    streak_before INTEGER NOT NULL DEFAULT 0,
    last_iteration INTEGER NOT NULL DEFAULT -1,
    last_slot INTEGER NOT NULL DEFAULT -1,
    served_epoch INTEGER NOT NULL DEFAULT -1,
    PRIMARY KEY (source, key)
) WITHOUT ROWID;
-- One prompt's graded completions at one iteration: count, mean reward, Welford's sum of squares.
CREATE TABLE IF NOT EXISTS groups (
    iteration INTEGER NOT NULL,
    sample_id TEXT NOT NULL,
    slot INTEGER NOT NULL,
    n INTEGER NOT NULL,
    mean REAL NOT NULL,
    m2 REAL NOT NULL,
    PRIMARY KEY (iteration, sample_id, slot)
) WITHOUT ROWID;
-- What an adaptive stage decided for an iteration, and the samplers' state after it.
CREATE TABLE IF NOT EXISTS decisions (
    iteration INTEGER PRIMARY KEY,
    stage INTEGER NOT NULL,
    sampler TEXT NOT NULL,
    state TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""

# Version 1 keyed grades without a slot and kept no served index; both are rebuilt from what it stored.
_MIGRATE_1_TO_2 = (
    """
ALTER TABLE grades RENAME TO grades_v1;
DROP INDEX IF EXISTS grades_by_stage;
"""
    + _SCHEMA
    + """
INSERT INTO grades (seq, iteration, sample_id, slot, completion_index, completion_sha, stage, source, reward,
                    components, error, created_at)
    SELECT seq, iteration, sample_id, -1, completion_index, completion_sha, stage, source, reward, components,
           error, created_at FROM grades_v1;
DROP TABLE grades_v1;
INSERT INTO served (sample_id, iteration)
    SELECT json_extract(s.value, '$.sample_id'), MAX(i.iteration) FROM iterations AS i, json_each(i.samples) AS s
    GROUP BY 1;
UPDATE meta SET value = '2' WHERE key = 'schema_version';
"""
)
# Version 2 had no per-record state: the new tables start empty (the grades before them are not folded in).
_MIGRATE_2_TO_3 = _SCHEMA + "UPDATE meta SET value = '3' WHERE key = 'schema_version';"


class StateMismatchError(ProctorError, RuntimeError):
    """The state file was written for another curriculum or seed."""


class StateInUseError(ProctorError, RuntimeError):
    """Another process serves from the same state file."""


class StateUnreachableError(ProctorError, RuntimeError):
    """The PostgreSQL database that holds the state does not answer."""


class SQLiteVersionError(ProctorError, RuntimeError):
    """Python's sqlite3 is older than the statements the store uses."""


class Store:
    """The state of one run, in a SQLite file (``path``) or a PostgreSQL database (``path`` a
    ``postgresql://`` URL)."""

    def __init__(self, path: str | Path, *, synchronous: Literal["normal", "full"] = "normal") -> None:
        self.path = str(path)
        self._lock: int | None = None
        if is_postgresql(self.path):
            self._open_postgresql()
            return
        if sqlite3.sqlite_version_info < (3, 35):
            # Grades are stored with INSERT … RETURNING (3.35, 2021).
            raise SQLiteVersionError(
                f"proctor needs SQLite 3.35 or newer, and Python's sqlite3 here uses {sqlite3.sqlite_version}; "
                "use a Python built against a newer SQLite (e.g. the python:3.11 Docker images)"
            )
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._lock = _hold(self.path)
        try:
            self._open(synchronous)
        except BaseException:
            if self._lock is not None:
                os.close(self._lock)
            raise

    def _open(self, synchronous: Literal["normal", "full"]) -> None:
        # The writer connection: one thread at a time uses it (the store's thread, see AsyncStore); the check is
        # off so that it may be created on another.
        self._db = Database.sqlite(self.path, synchronous=synchronous)
        # No automatic checkpoints: SQLite would run them inside whichever commit crosses 1000 WAL pages,
        # stalling that commit (and every request queued behind it) for milliseconds. AsyncStore runs
        # `checkpoint()` on another connection and thread instead, beside the writes.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        # Reads the event loop makes while the writer is busy on the store's thread (a file's other connections
        # read its last commit, WAL mode); an in-memory database has no other connection, so it reads through
        # the writer.
        self._reader = self._db
        if self.path != ":memory:":
            self._reader = Database.sqlite(self.path, synchronous=None)
            self._reader.execute("PRAGMA query_only=ON")
        if self._schema_version() == "1":
            self._db.script("BEGIN IMMEDIATE;" + _MIGRATE_1_TO_2 + "COMMIT;")
        if self._schema_version() == "2":
            self._db.script("BEGIN IMMEDIATE;" + _MIGRATE_2_TO_3 + "COMMIT;")
        self._db.script(_SCHEMA)
        self._opened()

    def _open_postgresql(self) -> None:
        try:
            self._db = Database.postgresql(self.path)
        except ConnectionError as exc:
            raise StateUnreachableError(
                f"the PostgreSQL database {self.display} does not answer ({exc}); check that it runs and that "
                "the URL in --state (PROCTOR_STATE) is right"
            ) from None
        try:
            # The flock of a state file, for a database: held by the writer connection until it closes (or the
            # process ends), however it ends.
            free = self._try_lock()
            if not free:
                raise StateInUseError(
                    f"database {self.display} is in use by another proctor serve; a proctor serve started on it "
                    "stands by for that one and takes over when it stops. One process serves a database at a time"
                )
            self._reader = Database.postgresql(self.path, application="proctor-reader")
            self._db.script(_SCHEMA)
        except BaseException:
            self._db.close()
            raise
        self._opened()

    def _try_lock(self) -> bool:
        # A server killed a moment ago holds the lock until the database notices its connection gone: give that
        # a second before calling the database taken.
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            (free,) = self._db.execute("SELECT pg_try_advisory_lock(?)", (_ADVISORY_KEY,)).fetchone()
            if free or time.monotonic() > deadline:
                return bool(free)
            time.sleep(0.05)

    def _opened(self) -> None:
        self._tracking = ItemTracking({}, frozenset(), 1.0)
        # A connection of its own for checkpoints, used from the checkpoint thread. The lock keeps `close`
        # from closing it under a checkpoint still running there: cancelling the task that awaits a thread does
        # not stop the thread, and SQLite crashes the process on a connection closed mid-statement.
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpoint_lock = threading.Lock()
        self._closed = False

    @staticmethod
    def check_free(path: str | Path) -> None:
        """Raise :class:`StateInUseError` when a process serves from the state file at ``path``."""
        if Path(path).exists():
            os.close(_hold(str(path)))

    @property
    def display(self) -> str:
        """Where the state is, for messages: the file, or the database's URL without its password."""
        return redacted(self.path)

    @property
    def described(self) -> str:
        """Where the state is, in a sentence: ``the state file …`` or ``the PostgreSQL database …``."""
        if self._db.dialect == "postgresql":
            return f"the PostgreSQL database {self.display}"
        return f"the state file {self.path}"

    @property
    def connection(self) -> Database:
        """The writer connection, for the experience store's tables in the same file and transactions."""
        return self._db

    @property
    def concurrent_reads(self) -> bool:
        """Whether the reads (:meth:`get_iteration`, :meth:`latest_served`, :meth:`graded_iterations`,
        :meth:`find_grades`) may run on another thread than the writes, beside them."""
        return self._reader is not self._db

    def _schema_version(self) -> str | None:
        if not self._db.table_exists("meta"):
            return None
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        with self._checkpoint_lock:
            self._closed = True
            if self._checkpointer is not None:
                self._checkpointer.close()
        if self.path != ":memory:" and self._db.dialect == "sqlite":
            # Fold the WAL into the database file, so that a stopped server leaves one file behind.
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if self._db.dialect == "postgresql":
            # Now, rather than when the database notices the connection gone: the next server may start at once.
            with contextlib.suppress(*self._db.errors):
                self._db.execute("SELECT pg_advisory_unlock(?)", (_ADVISORY_KEY,))
        if self._reader is not self._db:
            self._reader.close()
        self._db.close()
        if self._lock is not None:
            os.close(self._lock)  # and with it the lock
            self._lock = None

    def ping(self) -> None:
        """One round trip on the writer connection: an error when it no longer holds."""
        self._db.execute("SELECT 1").fetchone()

    def checkpoint(self, *, restart_after_frames: int) -> None:
        """Copy committed WAL frames into the database file, on a connection of its own (so from any thread).

        PASSIVE first, which never blocks the writer. Under steady writes a passive checkpoint never catches
        up with the writer, and SQLite only rewinds the WAL once one has; so when the WAL is longer than
        ``restart_after_frames``, a RESTART follows, which holds writers off for the little that is left.
        """
        if self.path == ":memory:" or self._db.dialect != "sqlite":
            return
        with self._checkpoint_lock:
            if self._closed:
                return
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._checkpointer.execute("PRAGMA busy_timeout=5000")
            _busy, frames, _done = self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if frames > restart_after_frames:
                self._checkpointer.execute("PRAGMA wal_checkpoint(RESTART)")

    # --- binding ------------------------------------------------------------------------------------------

    def bind(self, *, curriculum: str, curriculum_hash: str, seed: int) -> None:
        """Claim an empty state file for this curriculum, or check that it already belongs to it."""
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            with self._tx():
                self._db.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema_version", str(SCHEMA_VERSION)),
                        ("curriculum", curriculum),
                        ("curriculum_hash", curriculum_hash),
                        ("seed", str(seed)),
                        ("created_at", str(time.time())),
                    ],
                )
            return
        version = meta.get("schema_version")
        if version != str(SCHEMA_VERSION):
            newer = version is not None and version.isdigit() and int(version) > SCHEMA_VERSION
            raise StateMismatchError(
                f"{self.described} was written by a newer proctor (schema version {version}; this one reads up to "
                f"{SCHEMA_VERSION}): upgrade proctor to serve it, or start a new run with another --run or --state"
                if newer
                else f"{self.described} has schema version {version}, this proctor writes {SCHEMA_VERSION}; use a "
                "new --state path"
            )
        _check_binding(meta, self.described, curriculum, curriculum_hash, seed)

    def announce(self, url: str) -> None:
        """Record where this server answers, for the standbys of its PostgreSQL database (:class:`Standby`)."""
        with self._tx():
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('serving_url', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (url,),
            )

    # --- iterations -------------------------------------------------------------------------------------

    def get_iteration(self, iteration: int) -> IterationRow | None:
        row = self._reader.execute(
            "SELECT iteration, batch_size, stage, samples FROM iterations WHERE iteration = ?", (iteration,)
        ).fetchone()
        if row is None:
            return None
        return IterationRow(row[0], row[1], row[2], json.loads(row[3]))

    def record_iteration(
        self, row: IterationRow, transitions: Sequence[TransitionRecord], *, samples_json: str | None = None
    ) -> None:
        """Store a new iteration's batch together with the transitions decided for it, atomically, and index
        the iteration as the latest to serve each of its sample ids (unless a later one already did).

        ``samples_json`` is ``row.samples`` already encoded, when the caller has it.
        """
        self.record_iterations([(row, transitions, samples_json)])

    def record_iterations(self, entries: Sequence[tuple[IterationRow, Sequence[TransitionRecord], str | None]]) -> None:
        """:meth:`record_iteration` for several iterations (in the order given) in one transaction: one
        commit instead of one each."""
        now = time.time()
        with self._tx():
            for row, transitions, samples_json in entries:
                self._db.defer(
                    "INSERT INTO iterations (iteration, batch_size, stage, samples, created_at) VALUES (?, ?, ?, ?, ?)",
                    (row.iteration, row.batch_size, row.stage, samples_json or json.dumps(row.samples), now),
                )
                served = sorted({s["sample_id"] for s in row.samples})
                for part in _parts(served, _ROWS_PER_STATEMENT):
                    values, params = self._db.rows(("text", "bigint"), [(sid, row.iteration) for sid in part])
                    self._db.defer(
                        f"INSERT INTO served (sample_id, iteration) {values} ON CONFLICT (sample_id) DO UPDATE"
                        " SET iteration = excluded.iteration WHERE excluded.iteration > served.iteration",
                        params,
                    )
                self._insert_transitions(transitions, now)
                if row.decision is not None:
                    self._record_decision(row.iteration, row.stage, row.decision)

    def _record_decision(self, iteration: int, stage: int, decision: DecisionRow) -> None:
        self._db.defer(
            "INSERT INTO decisions (iteration, stage, sampler, state, detail) VALUES (?, ?, ?, ?, ?)",
            (iteration, stage, decision.sampler, json.dumps(decision.state), json.dumps(decision.detail)),
        )
        for part in _parts(list(decision.served), _ROWS_PER_STATEMENT):
            rows, params = self._db.rows(("text", "bigint", "bigint"), part)
            self._db.defer(
                f"INSERT INTO items (source, key, served_epoch) {rows}"
                " ON CONFLICT (source, key) DO UPDATE SET served_epoch = excluded.served_epoch",
                params,
            )

    def adopt_transitions(self, transitions: Sequence[TransitionRecord], decided_through: int | None) -> None:
        """Record transitions decided by another run, and how far that run had decided (see
        :class:`~proctor.server.curriculum.engine.StageSchedule`), atomically."""
        now = time.time()
        with self._tx():
            self._insert_transitions(transitions, now)
            current = self.decided_through()
            if decided_through is not None and (current is None or decided_through > current):
                self._db.execute(
                    "INSERT INTO meta (key, value) VALUES ('decided_through', ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (str(decided_through),),
                )

    def _insert_transitions(self, transitions: Sequence[TransitionRecord], now: float) -> None:
        for t in transitions:
            self._db.defer(
                "INSERT INTO transitions (iteration, from_stage, to_stage, reason, rolling_reward, rolling_count,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (t.iteration, t.from_stage, t.to_stage, t.reason, t.rolling_reward, t.rolling_count, now),
            )

    def decided_through(self) -> int | None:
        """The last iteration whose stage an adopted run decided; None when none was adopted."""
        row = self._db.execute("SELECT value FROM meta WHERE key = 'decided_through'").fetchone()
        return None if row is None else int(row[0])

    def last_iteration(self) -> int | None:
        value = self._db.execute("SELECT MAX(iteration) FROM iterations").fetchone()[0]
        return None if value is None else int(value)

    def transitions(self) -> list[TransitionRecord]:
        rows = self._db.execute(
            "SELECT iteration, from_stage, to_stage, reason, rolling_reward, rolling_count FROM transitions "
            "ORDER BY seq"
        ).fetchall()
        return [TransitionRecord(*r) for r in rows]

    def latest_served(self, sample_ids: Iterable[str]) -> dict[str, int]:
        """The latest iteration that served each id (ids never served are absent)."""
        out: dict[str, int] = {}
        for part in _parts(sorted(set(sample_ids)), _KEYS_PER_STATEMENT):
            marks = ",".join("?" * len(part))
            for sid, iteration in self._reader.execute(
                f"SELECT sample_id, iteration FROM served WHERE sample_id IN ({marks})", part
            ):
                out[sid] = int(iteration)
        return out

    def graded_iterations(self, iterations: Iterable[int]) -> set[int]:
        """Those of ``iterations`` with at least one stored grade (the unique key's index, a statement per few
        hundred iterations)."""
        out: set[int] = set()
        for part in _parts(sorted(set(iterations)), _KEYS_PER_STATEMENT):
            marks = ",".join("?" * len(part))
            out.update(
                i
                for (i,) in self._reader.execute(
                    f"SELECT DISTINCT iteration FROM grades WHERE iteration IN ({marks})", part
                )
            )
        return out

    def step_groups(self, iteration: int, limit: int) -> list[tuple[str, int, GroupState]]:
        """The first ``limit`` groups of a step, as ``(sample_id, slot, state)``, by slot then sample id."""
        rows = self._reader.execute(
            "SELECT sample_id, slot, n, mean, m2 FROM groups WHERE iteration = ? ORDER BY slot, sample_id LIMIT ?",
            (iteration, limit),
        )
        return [(sample_id, slot, GroupState(n, mean, m2)) for sample_id, slot, n, mean, m2 in rows]

    def records(self, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], ItemState]:
        """The stored state of the records ``(source, key)`` that have one."""
        out: dict[tuple[str, int], ItemState] = {}
        for part in _parts(sorted(set(keys)), _KEYS_PER_STATEMENT):
            values, params = self._reader.rows(_RECORD_KEY, part)
            rows = self._reader.execute(
                f"WITH k (source, key) AS ({values}) SELECT i.source, i.key, i.passes, i.fails, i.groups,"
                " i.streak, i.streak_before, i.last_iteration, i.last_slot, i.served_epoch"
                " FROM k JOIN items AS i USING (source, key)",
                params,
            )
            for source, key, passes, fails, groups, streak, before, iteration, slot, served in rows:
                out[(source, key)] = ItemState(passes, fails, groups, streak, before, (iteration, slot), served)
        return out

    # --- grades -----------------------------------------------------------------------------------------

    def find_grades(self, keys: Iterable[GradeKey]) -> dict[GradeKey, GradeRow]:
        """The stored grades of ``keys`` (keys without one are absent), a statement per few hundred keys."""
        out: dict[GradeKey, GradeRow] = {}
        for part in _parts(list(keys), _KEYS_PER_STATEMENT):
            values, params = self._reader.rows(_GRADE_KEY, part)
            rows = self._reader.execute(
                f"WITH k (iteration, sample_id, slot, completion_index, completion_sha) AS ({values})"
                " SELECT g.iteration, g.sample_id, g.slot, g.completion_index, g.completion_sha, g.stage, g.source,"
                " g.reward, g.components, g.error FROM k JOIN grades AS g"
                " USING (iteration, sample_id, slot, completion_index, completion_sha)",
                params,
            )
            for *key, stage, source, reward, components, error in rows:
                k: GradeKey = (key[0], key[1], key[2], key[3], key[4])
                out[k] = GradeRow(k, stage, source, reward, json.loads(components), error)
        return out

    def track_items(self, tracking: ItemTracking) -> None:
        """Fold every grade stored from now on into its group and, for the finite sources, its record."""
        self._tracking = tracking

    def insert_grades(self, rows: Sequence[GradeRow]) -> StoredGrades:
        """Store grades in one transaction. Per row: ``inserted``; ``replaced_error`` when it replaces a stored
        error result of the same key (errors are retried, successes are final); ``exists`` when a successful
        grade of that key was already stored (a concurrent duplicate), which the caller reads back instead.

        In the same transaction, each new error-free grade is folded into its group and its record
        (:mod:`proctor.server.state.items`), so the per-record state never runs ahead of the grades."""
        now = time.time()
        written: dict[GradeKey, GradeOutcome] = {}
        postgresql = self._db.dialect == "postgresql"
        with self._tx():
            # Which rows the upsert inserted, and which errors it replaced: PostgreSQL says so (a row version
            # no transaction has replaced, xmax 0, is new). On SQLite, one writer in a transaction: a row whose
            # seq is above the largest before it was inserted now.
            before = 0
            if not postgresql:
                (before,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM grades").fetchone()
            new, after = ("xmax = 0", []) if postgresql else ("seq > ?", [before])
            for part in _parts(list(rows), _ROWS_PER_STATEMENT):
                values, params = self._db.rows(
                    (*_GRADE_KEY, "bigint", "text", "double precision", "text", "text", "double precision"),
                    [(*r.key, r.stage, r.source, r.reward, json.dumps(r.components), r.error, now) for r in part],
                )
                returned = self._db.execute(
                    "INSERT INTO grades (iteration, sample_id, slot, completion_index, completion_sha, stage, source,"
                    f" reward, components, error, created_at) {values}"
                    " ON CONFLICT (iteration, sample_id, slot, completion_index, completion_sha) DO UPDATE SET"
                    " stage = excluded.stage, source = excluded.source, reward = excluded.reward,"
                    " components = excluded.components, error = excluded.error, created_at = excluded.created_at"
                    " WHERE grades.error IS NOT NULL"
                    f" RETURNING {new}, iteration, sample_id, slot, completion_index, completion_sha",
                    params + after,
                ).fetchall()
                for inserted, *key in returned:
                    written[(key[0], key[1], key[2], key[3], key[4])] = "inserted" if inserted else "replaced_error"
            items, groups = self._fold([r for r in rows if r.error is None and r.key in written])
        return StoredGrades([written.get(r.key, "exists") for r in rows], items, groups)

    def _fold(self, rows: Sequence[GradeRow]) -> tuple[list[tuple[str, int, ItemState]], list[GroupChange]]:
        if not rows:
            return [], []
        tracking = self._tracking
        group_keys = list(dict.fromkeys((r.key[0], r.key[1], r.key[2]) for r in rows))
        groups = dict.fromkeys(group_keys, NEW_GROUP)
        for gpart in _parts(group_keys, _KEYS_PER_STATEMENT):
            values, params = self._db.rows(_GROUP_KEY, gpart)
            for iteration, sample_id, slot, n, mean, m2 in self._db.execute(
                f"WITH k (iteration, sample_id, slot) AS ({values}) SELECT g.iteration, g.sample_id, g.slot,"
                " g.n, g.mean, g.m2 FROM k JOIN groups AS g USING (iteration, sample_id, slot)",
                params,
            ):
                groups[(iteration, sample_id, slot)] = GroupState(n, mean, m2)
        first = dict(groups)
        record_keys = list(
            dict.fromkeys((r.source, _record_key(r.key[1])) for r in rows if r.source in tracking.finite)
        )
        items = {k: ItemState() for k in record_keys}
        for ipart in _parts(record_keys, _KEYS_PER_STATEMENT):
            values, params = self._db.rows(_RECORD_KEY, ipart)
            for source, record, *fields in self._db.execute(
                f"WITH k (source, key) AS ({values}) SELECT i.source, i.key, i.passes, i.fails, i.groups,"
                " i.streak, i.streak_before, i.last_iteration, i.last_slot, i.served_epoch"
                " FROM k JOIN items AS i USING (source, key)",
                params,
            ):
                passes, fails, n_groups, streak, streak_before, last_iteration, last_slot, served = fields
                items[(source, record)] = ItemState(
                    passes, fails, n_groups, streak, streak_before, (last_iteration, last_slot), served
                )
        for r in rows:
            gkey = (r.key[0], r.key[1], r.key[2])
            group = groups[gkey]
            updated = groups[gkey] = group.add(r.reward)
            if r.source in tracking.finite:
                ikey = (r.source, _record_key(r.key[1]))
                passed = r.reward >= tracking.pass_thresholds.get(r.source, 1.0)
                items[ikey] = fold_grade(items[ikey], group, updated, (r.key[0], r.key[2]), passed, tracking.decay)
        for gpart in _parts(group_keys, _ROWS_PER_STATEMENT):
            values, params = self._db.rows(
                (*_GROUP_KEY, "bigint", "double precision", "double precision"),
                [(*k, groups[k].n, groups[k].mean, groups[k].m2) for k in gpart],
            )
            self._db.defer(
                f"INSERT INTO groups (iteration, sample_id, slot, n, mean, m2) {values}"
                " ON CONFLICT (iteration, sample_id, slot) DO UPDATE SET n = excluded.n, mean = excluded.mean,"
                " m2 = excluded.m2",
                params,
            )
        for ipart in _parts(record_keys, _ROWS_PER_STATEMENT):
            # served_epoch is the sampler's to write (with the iterations), never the grades'.
            values, params = self._db.rows(
                (
                    *_RECORD_KEY,
                    "double precision",
                    "double precision",
                    "bigint",
                    "bigint",
                    "bigint",
                    "bigint",
                    "bigint",
                ),
                [
                    (*k, st.passes, st.fails, st.groups, st.streak, st.streak_before, *st.last_group)
                    for k in ipart
                    for st in (items[k],)
                ],
            )
            self._db.defer(
                "INSERT INTO items (source, key, passes, fails, groups, streak, streak_before, last_iteration,"
                f" last_slot) {values}"
                " ON CONFLICT (source, key) DO UPDATE SET passes = excluded.passes, fails = excluded.fails,"
                " groups = excluded.groups, streak = excluded.streak, streak_before = excluded.streak_before,"
                " last_iteration = excluded.last_iteration, last_slot = excluded.last_slot",
                params,
            )
        changes = [GroupChange(k[0], first[k], groups[k]) for k in group_keys]
        return [(source, key, items[(source, key)]) for source, key in record_keys], changes

    # --- statistics for a restart -----------------------------------------------------------------------

    def stage_totals(self) -> dict[int, StageTotals]:
        out: dict[int, dict[str, Any]] = {}
        for stage, iterations, samples in self._db.execute(
            "SELECT stage, COUNT(*), SUM(batch_size) FROM iterations GROUP BY stage"
        ):
            out.setdefault(stage, {}).update(iterations=iterations, samples=samples or 0)
        for stage, graded, errors, reward_sum in self._db.execute(
            "SELECT stage, " + _GRADE_SUMS + " FROM grades GROUP BY stage"
        ):
            out.setdefault(stage, {}).update(graded=graded or 0, errors=errors or 0, reward_sum=reward_sum or 0.0)
        return {stage: StageTotals(**fields) for stage, fields in out.items()}

    def recent_rewards(self, stage: int, limit: int) -> list[float]:
        """The latest ``limit`` error-free rewards of a stage, oldest first."""
        rows = self._db.execute(
            "SELECT reward FROM grades WHERE stage = ? AND error IS NULL ORDER BY seq DESC LIMIT ?",
            (stage, limit),
        ).fetchall()
        return [r[0] for r in reversed(rows)]

    def item_rows(self, source: str) -> list[tuple[int, float, float, int, int, int]]:
        """Every stored record of ``source``: ``(key, passes, fails, groups, streak, served_epoch)``."""
        rows = self._db.execute(
            "SELECT key, passes, fails, groups, streak, served_epoch FROM items WHERE source = ?", (source,)
        )
        return [(key, passes, fails, groups, streak, served) for key, passes, fails, groups, streak, served in rows]

    def last_decision(self) -> tuple[int, dict[str, Any]] | None:
        """The latest iteration an adaptive stage decided, and the samplers' state after it."""
        row = self._db.execute("SELECT iteration, state FROM decisions ORDER BY iteration DESC LIMIT 1").fetchone()
        return None if row is None else (int(row[0]), json.loads(row[1]))

    def decision_details(self, first: int) -> dict[int, tuple[str, dict[str, Any]]]:
        """``(sampler, detail)`` of the decided iterations from ``first`` on."""
        return {
            int(i): (sampler, json.loads(detail))
            for i, sampler, detail in self._db.execute(
                "SELECT iteration, sampler, detail FROM decisions WHERE iteration >= ?", (first,)
            )
        }

    def iteration_totals(self, first: int) -> list[IterationTotals]:
        """Per iteration from ``first`` on: its grades and its groups, in iteration order."""
        out: dict[int, dict[str, Any]] = {}
        for iteration, stage in self._db.execute(
            "SELECT iteration, stage FROM iterations WHERE iteration >= ? ORDER BY iteration", (first,)
        ):
            out[iteration] = {"stage": stage}
        for iteration, graded, errors, reward_sum in self._db.execute(
            "SELECT iteration, " + _GRADE_SUMS + " FROM grades WHERE iteration >= ? GROUP BY iteration",
            (first,),
        ):
            if iteration in out:
                out[iteration].update(graded=graded or 0, errors=errors or 0, reward_sum=reward_sum or 0.0)
        for iteration, counted, zero in self._db.execute(
            "SELECT iteration, SUM(CASE WHEN n >= 2 THEN 1 ELSE 0 END),"
            f" SUM(CASE WHEN n >= 2 AND m2 <= {ZERO_VARIANCE!r} THEN 1 ELSE 0 END) FROM groups WHERE iteration >= ?"
            " GROUP BY iteration",
            (first,),
        ):
            if iteration in out:
                out[iteration].update(groups=counted or 0, zero_variance_groups=zero or 0)
        return [
            IterationTotals(
                iteration,
                fields["stage"],
                fields.get("graded", 0),
                fields.get("errors", 0),
                fields.get("reward_sum", 0.0),
                fields.get("groups", 0),
                fields.get("zero_variance_groups", 0),
            )
            for iteration, fields in out.items()
        ]

    def recent_errors(self, limit: int) -> list[tuple[int, str, str]]:
        """The latest ``limit`` grader errors, newest first: ``(iteration, sample_id, error)``."""
        rows = self._db.execute(
            "SELECT iteration, sample_id, error FROM grades WHERE error IS NOT NULL ORDER BY seq DESC LIMIT ?",
            (limit,),
        )
        return [(iteration, sample_id, error) for iteration, sample_id, error in rows]

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


@dataclass(frozen=True, slots=True)
class Holder:
    """What a standby sees of its database: whether the serving lock is free, and where the server that holds
    it said it answers (None before one has said)."""

    free: bool
    serving_url: str | None


class Standby:
    """A server's view of a PostgreSQL database that another server holds: one connection, without the lock,
    that watches whether the lock is free and where the serving one answers.

    Several ``proctor serve`` processes may share a database: one serves (it holds the advisory lock) and the
    others stand by, forwarding requests to it and taking over when its connection ends."""

    def __init__(self, path: str, *, curriculum: str, curriculum_hash: str, seed: int) -> None:
        self.path = path
        self._binding = (curriculum, curriculum_hash, seed)
        try:
            self._db = Database.postgresql(path, application="proctor-standby")
        except ConnectionError as exc:
            raise StateUnreachableError(f"the PostgreSQL database {redacted(path)} does not answer ({exc})") from None

    def poll(self) -> Holder:
        """Whether the lock is free now, and the serving server's URL. Raises :class:`StateMismatchError` when
        the database belongs to another curriculum, as the serving one would."""
        db = self._db
        meta: dict[str, str] = {}
        if db.table_exists("meta"):
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if "curriculum_hash" in meta:
            _check_binding(meta, f"the PostgreSQL database {redacted(self.path)}", *self._binding)
        (free,) = db.execute("SELECT pg_try_advisory_lock(?)", (_ADVISORY_KEY,)).fetchone()
        if free:
            db.execute("SELECT pg_advisory_unlock(?)", (_ADVISORY_KEY,))  # to be taken by the store that serves
        return Holder(bool(free), meta.get("serving_url"))

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        return self._db.errors

    def close(self) -> None:
        self._db.close()


def _check_binding(meta: dict[str, str], described: str, curriculum: str, curriculum_hash: str, seed: int) -> None:
    if meta.get("curriculum_hash") != curriculum_hash or meta.get("seed") != str(seed):
        raise StateMismatchError(
            f"{described} belongs to curriculum {meta.get('curriculum')!r} "
            f"(hash {meta.get('curriculum_hash')}, seed {meta.get('seed')}), but the server loaded "
            f"{curriculum!r} (hash {curriculum_hash}, seed {seed}). The curriculum, its data or its seed "
            "changed since this state was written: start a new run with another --run name or --state path "
            "(PROCTOR_RUN, PROCTOR_STATE), or discard this one with --fresh"
        )


def _hold(path: str) -> int:
    """An exclusive lock on the state file, held until :meth:`Store.close` (or the process's end, however it
    ends): two servers on one file would each decide batches and lease rows from memory of their own. ``flock``
    is apart from the byte-range locks SQLite takes, so they do not meet."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateInUseError(
            f"state file {path} is in use by another proctor serve; stop that one, or give this one another "
            "--run or --state (PROCTOR_RUN, PROCTOR_STATE). One state file serves one process"
        ) from None
    except OSError:
        pass  # a file system without flock (some network mounts): nothing to hold, as before
    return fd


def _record_key(sample_id: str) -> int:
    return int(sample_id.rsplit(":", 1)[1])


def _parts(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def redacted(target: str) -> str:
    """A state setting as messages show it: a database URL's password replaced by ``***``."""
    if not is_postgresql(target):
        return target
    parts = urlsplit(target)
    if parts.password is None:
        return target
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class _Transaction:
    """A transaction (``BEGIN IMMEDIATE`` on SQLite) … ``COMMIT``, rolled back on error."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._outer = False

    def __enter__(self) -> None:
        # Inside a transaction already (one the experience store began on the shared connection): part of it.
        self._outer = self._db.in_transaction
        if not self._outer:
            self._db.begin()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._outer:
            if exc_type is None:
                self._db.commit()
            else:
                self._db.rollback()
