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

from proctor.server.store.connection import (
    SQLiteVersionError,
    StateInUseError,
    StateMismatchError,
    StateUnreachableError,
    redacted,
)
from proctor.server.store.grades import GradeQueries
from proctor.server.store.iterations import IterationQueries
from proctor.server.store.progress import ProgressQueries
from proctor.server.store.schema import SCHEMA_VERSION
from proctor.server.store.standby import Holder, Standby, StandbyReads

__all__ = [
    "SCHEMA_VERSION",
    "Holder",
    "SQLiteVersionError",
    "Standby",
    "StandbyReads",
    "StateInUseError",
    "StateMismatchError",
    "StateUnreachableError",
    "Store",
    "redacted",
]


class Store(IterationQueries, GradeQueries, ProgressQueries):
    """The state of one run, in a SQLite file (``path``) or a PostgreSQL database (``path`` a ``postgresql://``
    URL): what was served, the grades, and the progress read back (each its own module of this package), over
    one :class:`~proctor.server.store.connection.StateConnection`."""
