"""Opening a run's state and holding it: the writer and reader connections, the file lock or the
advisory lock, the binding to one curriculum, transactions, checkpoints."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from proctor.experience.database import Database, is_postgresql
from proctor.server.exceptions import ProctorError
from proctor.server.state.items import ItemTracking
from proctor.server.store.schema import (
    MIGRATE_1_TO_2,
    MIGRATE_2_TO_3,
    MIGRATE_3_TO_4,
    MIGRATE_4_TO_5,
    SCHEMA,
    SCHEMA_VERSION,
)

__all__ = [
    "SQLiteVersionError",
    "StateConnection",
    "StateInUseError",
    "StateMismatchError",
    "StateUnreachableError",
    "redacted",
]

T = TypeVar("T")

# Rows and keys per statement: far below SQLite's limit of 32,766 bound values.
_ROWS_PER_STATEMENT = 256
_KEYS_PER_STATEMENT = 512
# The advisory lock a server holds on its PostgreSQL database (any number: the database is proctor's).
_ADVISORY_KEY = 0x70726F63746F72
_LOCK_WAIT_S = 1.0


class StateMismatchError(ProctorError, RuntimeError):
    """The state file was written for another curriculum or seed."""


class StateInUseError(ProctorError, RuntimeError):
    """Another process serves from the same state file."""


class StateUnreachableError(ProctorError, RuntimeError):
    """The PostgreSQL database that holds the state does not answer."""


class SQLiteVersionError(ProctorError, RuntimeError):
    """Python's sqlite3 is older than the statements the store uses."""


class StateConnection:
    """The state of one run, in a SQLite file (``path``) or a PostgreSQL database (``path`` a ``postgresql://``
    URL): opening it and holding it against other servers, binding it to a curriculum, transactions, WAL
    checkpoints, closing."""

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
            self._db.script("BEGIN IMMEDIATE;" + MIGRATE_1_TO_2 + "COMMIT;")
        if self._schema_version() == "2":
            self._db.script("BEGIN IMMEDIATE;" + MIGRATE_2_TO_3 + "COMMIT;")
        if self._schema_version() == "3":
            self._db.script("BEGIN IMMEDIATE;" + MIGRATE_3_TO_4 + "COMMIT;")
        if self._schema_version() == "4":
            # A file migrated from version 1 made its grades table with this version's columns already.
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(grades)").fetchall()}
            add = "" if "details" in columns else "ALTER TABLE grades ADD COLUMN details TEXT;"
            self._db.script("BEGIN IMMEDIATE;" + add + MIGRATE_4_TO_5 + "COMMIT;")
        self._db.script(SCHEMA)
        self._opened()

    def _open_postgresql(self) -> None:
        try:
            self._db = Database.postgresql(self.path)
        except ConnectionError as exc:
            raise StateUnreachableError(
                f"the PostgreSQL database {self.display} does not answer ({exc}); check that it runs and that "
                "the URL in --database-url (PROCTOR_DATABASE_URL) is right"
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
            if self._schema_version() == "3":
                self._db.script(MIGRATE_3_TO_4)
            if self._schema_version() == "4":
                self._db.script("ALTER TABLE grades ADD COLUMN IF NOT EXISTS details TEXT;" + MIGRATE_4_TO_5)
            self._db.script(SCHEMA)
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
                f"{SCHEMA_VERSION}): upgrade proctor to serve it, or start a new run with another --run or "
                "--database-url"
                if newer
                else f"{self.described} has schema version {version}, this proctor writes {SCHEMA_VERSION}; use a "
                "new --database-url path"
            )
        _check_binding(meta, self.described, curriculum, curriculum_hash, seed)

    def announce(self, url: str) -> str:
        """Record where this server answers, for the standbys of its PostgreSQL database (:class:`Standby`), with
        a new token that they send with the completions they grade for it; returns the token. Whoever reads
        the database may act as a standby: the token is worth what its credentials are."""
        token = secrets.token_hex(16)
        with self._tx():
            for key, value in (("serving_url", url), ("serving_token", token)):
                self._db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
        return token

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


def _check_binding(meta: dict[str, str], described: str, curriculum: str, curriculum_hash: str, seed: int) -> None:
    if meta.get("curriculum_hash") != curriculum_hash or meta.get("seed") != str(seed):
        raise StateMismatchError(
            f"{described} belongs to curriculum {meta.get('curriculum')!r} "
            f"(hash {meta.get('curriculum_hash')}, seed {meta.get('seed')}), but the server loaded "
            f"{curriculum!r} (hash {curriculum_hash}, seed {seed}). The curriculum, its data or its seed "
            "changed since this state was written: start a new run with another --run name or --database-url path "
            "(PROCTOR_RUN, PROCTOR_DATABASE_URL), or discard this one with --fresh"
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
            "--run or --database-url (PROCTOR_RUN, PROCTOR_DATABASE_URL). One state file serves one process"
        ) from None
    except OSError:
        pass  # a file system without flock (some network mounts): nothing to hold, as before
    return fd


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
