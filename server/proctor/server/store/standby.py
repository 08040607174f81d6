"""A server's view of a PostgreSQL database another server holds."""

from __future__ import annotations

from dataclasses import dataclass

from proctor.experience.database import Database
from proctor.server.store.connection import _ADVISORY_KEY, StateUnreachableError, _check_binding, redacted
from proctor.server.store.grades import GradeQueries
from proctor.server.store.iterations import IterationQueries

__all__ = ["Holder", "Standby", "StandbyReads"]


@dataclass(frozen=True, slots=True)
class Holder:
    """What a standby sees of its database: whether the serving lock is free, and where the server that holds
    it said it answers (None before one has said)."""

    free: bool
    serving_url: str | None
    token: str | None = None
    """What the serving server accepts with completions a standby graded for it (:meth:`StateConnection.announce`)."""


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
        return Holder(bool(free), meta.get("serving_url"), meta.get("serving_token"))

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        return self._db.errors

    def close(self) -> None:
        self._db.close()


class StandbyReads(IterationQueries, GradeQueries):
    """The look-ups of a standby that grades ``/grade`` requests itself: the serving server's own queries of
    served batches and stored grades, through a read-only connection of the standby's.

    Only the reader is opened (not :class:`StateConnection`'s writer, which would take the lock and migrate the
    schema: the serving server holds both), so only the queries that read through it may be called."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._reader = Database.postgresql(path, application="proctor-standby-reader")
        except ConnectionError as exc:
            raise StateUnreachableError(f"the PostgreSQL database {redacted(path)} does not answer ({exc})") from None
        self._reader.execute("SET default_transaction_read_only = on")

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        return self._reader.errors

    def close(self) -> None:
        self._reader.close()
