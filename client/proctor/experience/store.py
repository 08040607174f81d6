"""``ExperienceStore``: every rollout of recent generation steps, column by column, shared by the roles that
produce and consume it.

One table per generation step (``iteration``) of ``slots × group_size`` rows: row ``(slot, index)`` is the
``index``-th completion of the prompt in ``slot`` of that step's batch. The group size may be left open when the
table is opened (the dataserver opens a step's table when it samples it, before anyone says how many
completions a prompt gets); a prompt's rows are then those written so far. Columns are named and each cell is
written once (writing the same value again is a no-op, so a retried write is safe; another value is refused).
A column is written per row, or per slot (a value every row of the slot shares, such as its prompt).

Consumers are named roles that declare the columns they need (and may write). ``dispatch`` hands a consumer
up to ``count`` rows whose needed columns are all written, that it has not consumed, and where none of the
columns it writes is written yet (a writer that wrote a result itself leaves the consumer nothing to do there;
such rows count as consumed), under a *lease*: no
other caller of that consumer gets those rows until the lease is collected or expires, when they return to
the pool. ``collect`` writes the consumer's results for the leased rows and marks them consumed. Each
consumer has its own consumption state, so roles never wait for each other, only for the columns they need.
Reads by index (``read``) and plain writes (``put``) never wait and claim nothing.

Every change is committed to SQLite before the call returns, leases included, so a ``kill -9`` loses nothing
acknowledged and a restarted store hands out exactly what it would have. Retention keeps the last
``keep_iterations`` tables. All methods are thread-safe; a claim is atomic.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from proctor.experience.cells import CellStore
from proctor.experience.consumers import (
    Collected,
    Consumer,
    Consumption,
    Dispatch,
    balanced_parts,
    even_parts,
)
from proctor.experience.database import Database
from proctor.experience.errors import (
    ExperienceInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
)
from proctor.experience.limits import ExperienceLimits, check_count, check_name
from proctor.experience.persistence import Lease
from proctor.experience.tables import Index, RowKey, Table, age_of
from proctor.experience.values import Value, decode_cells, decode_columns

__all__ = ["ExperienceStore"]

_WAIT_LOOK_S = 0.01  # how often a waiting dispatch looks for ready rows
_Found = TypeVar("_Found")
_Columns = Literal["values", "cells", "none"]  # what a claim hands out of its rows' needed columns


class ExperienceStore(CellStore):
    """The store, in this process, durable in the SQLite file ``path`` (``:memory:`` for a throwaway one) or the
    PostgreSQL database at ``path`` (a ``postgresql://`` URL): the tables and cells of :class:`CellStore`, and
    the consumers that take their rows under leases.

    Args:
        path: the SQLite file, a PostgreSQL URL, or a connection to share (the dataserver passes its state's writer, so
            that its own writes and the store's can be one transaction; the connection stays its caller's).
        keep_iterations: tables kept (of steps, and as many of loose rows); opening one more drops the oldest.
        clock: wall-clock seconds, for lease expiry (a lease outlives a restart, so not a monotonic clock).
    """

    def __init__(
        self,
        path: str | Path | Database = ":memory:",
        *,
        keep_iterations: int = 8,
        synchronous: Literal["normal", "full"] = "normal",
        limits: ExperienceLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._consumers: dict[str, Consumer] = {}
        self._leases: dict[str, Lease] = {}  # every lease of the tables kept, by token
        self._live: dict[str, Lease] = {}  # those still held: the ones expiry has to look at
        # Per consumer, the tables that may have rows ready for it: a dispatch without an iteration looks at
        # these only. A table leaves when a dispatch finds nothing there, and comes back with a write to it,
        # or an expired lease of the consumer's in it.
        self._maybe: dict[str, set[int]] = {}
        super().__init__(path, keep_iterations=keep_iterations, synchronous=synchronous, limits=limits)

    def _forget(self) -> None:
        super()._forget()
        self._consumers, self._leases, self._live, self._maybe = {}, {}, {}, {}

    def _load(self) -> None:
        super()._load()
        for name, needs, produces, dispatch_size in self._db.consumers():
            self._consumers[name] = Consumer(name, needs, produces, dispatch_size)
            self._maybe[name] = set(self._tables)
        for lease in self._db.leases():
            table = self._tables.get(lease.iteration)
            if table is None:
                continue
            self._leases[lease.lease] = lease
            where = (lease.slots, lease.indices)
            if lease.state == "held":
                self._live[lease.lease] = lease
                table.mask(table.held, lease.consumer)[where] = True
            elif lease.state == "collected":
                table.mask(table.consumed, lease.consumer)[where] = True
            if lease.state != "expired":
                table.take(lease.consumer, len(lease.slots))

    def _opened(self, iteration: int, dropped: Sequence[int]) -> None:
        for maybe in self._maybe.values():
            maybe.difference_update(dropped)
            maybe.add(iteration)
        if dropped:
            gone = set(dropped)
            self._leases = {k: v for k, v in self._leases.items() if v.iteration not in gone}
            self._live = {k: v for k, v in self._live.items() if v.iteration not in gone}

    def _written(self, iteration: int) -> None:
        for maybe in self._maybe.values():
            maybe.add(iteration)

    # --- consumers ------------------------------------------------------------------------------------------

    def register(
        self, name: str, *, needs: Sequence[str], produces: Sequence[str] = (), dispatch_size: int | None = None
    ) -> Consumer:
        """Declare a consumer, or check that it is declared with these columns (registering is idempotent)."""
        check_name("name", name)
        for what, columns in (("needs", needs), ("produces", produces)):
            if isinstance(columns, str):
                raise ExperienceInputError(what, f"a list of column names, not the string {columns!r}")
            if len(columns) > self.limits.max_columns:
                raise ExperienceInputError(what, f"{len(columns)} columns; at most {self.limits.max_columns}")
            for n, column in enumerate(columns):
                check_name(f"{what}[{n}]", column)
        if not needs:
            raise ExperienceInputError("needs", "a consumer needs at least one column, the one whose rows it reads")
        if dispatch_size is not None:
            check_count("dispatch_size", dispatch_size, 1, self.limits.max_rows_per_call)
        consumer = Consumer(name, tuple(dict.fromkeys(needs)), tuple(dict.fromkeys(produces)), dispatch_size)
        with self._lock:
            known = self._consumers.get(name)
            if known is not None:
                if known != consumer:
                    raise ShapeConflictError(
                        f"consumer {name!r} is registered as needs={list(known.needs)}, produces="
                        f"{list(known.produces)}, dispatch_size={known.dispatch_size}; register it the same way, "
                        "or use another name"
                    )
                return known
            with self._db.transaction():
                self._db.add_consumer(name, consumer.needs, consumer.produces, dispatch_size)
            self._consumers[name] = consumer
            self._maybe[name] = set(self._tables)
            return consumer

    def consumers(self) -> list[Consumer]:
        with self._lock:
            return sorted(self._consumers.values(), key=lambda c: c.name)

    def _consumer(self, name: str) -> Consumer:
        consumer = self._consumers.get(name)
        if consumer is None:
            raise UnknownConsumerError(f"consumer {name!r} is not registered; register it with the columns it needs")
        return consumer

    # --- consuming ------------------------------------------------------------------------------------------

    def dispatch(
        self,
        consumer: str,
        count: int | None = None,
        *,
        iteration: int | None = None,
        groups: bool = False,
        dp_size: int = 1,
        balance_by: str | None = None,
        max_tokens_per_microbatch: int | None = None,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
        cells: bool = False,
    ) -> Dispatch:
        """Claim up to ``count`` rows ready for ``consumer`` (its ``dispatch_size`` when not given).

        ``iteration`` picks the table; without it, the oldest table with a ready row. ``groups`` hands out
        whole groups only (all completions of a prompt, once all are ready); ``count`` is then a multiple of
        the group size. ``dp_size`` splits the rows among that many readers; ``balance_by`` (a needed column:
        an array, whose length counts, or an integer) balances them by tokens with the dynamic-batching
        planner, under ``max_tokens_per_microbatch`` when given. The rows are leased for ``lease_s``
        seconds. With no row ready, the dispatch is empty, at once or, with ``wait_s``, once that many seconds
        passed without one (the calling thread looks again every few milliseconds meanwhile, holding nothing).
        With ``cells``, the dispatch's columns hold each cell's stored bytes, as :meth:`read_cells` gives them.
        """
        return _looked(
            wait_s,
            lambda: self._dispatch(
                consumer,
                count,
                iteration,
                groups,
                dp_size,
                balance_by,
                max_tokens_per_microbatch,
                lease_s,
                "cells" if cells else "values",
            ),
            lambda batch: batch.lease is None,
        )

    def _dispatch(
        self,
        consumer: str,
        count: int | None,
        iteration: int | None,
        groups: bool,
        dp_size: int,
        balance_by: str | None,
        max_tokens_per_microbatch: int | None,
        lease_s: float,
        columns: _Columns,
    ) -> Dispatch:
        check_count("dp_size", dp_size, 1, 4096)
        self._check_lease_s(lease_s)
        if groups and balance_by is not None:
            raise ExperienceInputError(
                "balance_by", "groups keeps a prompt's completions together and balance_by splits rows; ask for one"
            )
        with self._lock:
            c = self._consumer(consumer)
            want = self._want(c, count)
            if balance_by is not None and balance_by not in c.needs:
                raise ExperienceInputError(
                    "balance_by", f"{balance_by!r} is not among consumer {consumer!r}'s needs {list(c.needs)}"
                )
            now = self._clock()
            self._expire(now)
            if iteration is not None:
                candidates = [self._table(iteration)]
                if groups and candidates[0].group_size is None:
                    raise ExperienceInputError(
                        "groups", f"iteration {iteration} has no group_size yet; open it with one to hand out groups"
                    )
            else:
                candidates = [self._tables[i] for i in sorted(self._maybe[c.name], key=age_of)]
                if groups:
                    candidates = [t for t in candidates if t.group_size is not None]
            for table in candidates:
                slots, indices = self._choose(table, c, want, groups)
                if len(slots):
                    return self._claim(
                        table,
                        c,
                        slots,
                        indices,
                        now + lease_s,
                        dp_size,
                        groups,
                        balance_by,
                        max_tokens_per_microbatch,
                        columns,
                    )
                if iteration is None and not groups:
                    self._maybe[c.name].discard(table.iteration)
            return Dispatch(consumer, iteration, None, None, (), {}, ())

    def dispatch_many(
        self,
        consumer: str,
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
        cells: bool = False,
    ) -> tuple[Dispatch, ...]:
        """Up to ``count`` rows ready for ``consumer`` in all, from up to ``tables`` tables, the oldest first: one
        :class:`Dispatch` per table, each under a lease of its own, in one transaction. Empty when no row is
        ready, at once or, with ``wait_s``, once that many seconds passed without one. A worker whose rows come
        one table at a time (each step of a run, each ``/grade`` outside one) makes one call for several."""
        check_count("tables", tables, 1, self.limits.max_tables_per_call)
        self._check_lease_s(lease_s)
        with self._lock:  # refused here, a bad request costs no rollback of the batch below
            want = self._want(self._consumer(consumer), count)
        columns: _Columns = "cells" if cells else "values"

        def look() -> tuple[Dispatch, ...]:
            found: list[Dispatch] = []
            with self._lock:
                self._expire(self._clock())
                # A look that can find nothing (a long poll's, mostly) opens no transaction.
                if self._maybe[consumer]:
                    with self.batch():
                        left = want
                        while len(found) < tables and left > 0:
                            batch = self._dispatch(consumer, left, None, False, 1, None, None, lease_s, columns)
                            if batch.lease is None:
                                break
                            found.append(batch)
                            left -= len(batch)
            return tuple(found)

        return _looked(wait_s, look, lambda found: not found)

    def _want(self, c: Consumer, count: int | None) -> int:
        """The rows a dispatch of ``c`` asks for: ``count``, or the consumer's ``dispatch_size``."""
        want = count if count is not None else c.dispatch_size
        if want is None:
            raise ExperienceInputError("count", f"consumer {c.name!r} has no dispatch_size; give count")
        check_count("count", want, 1, self.limits.max_rows_per_call)
        return want

    def claim(
        self, consumer: str, iteration: int, rows: Sequence[RowKey], *, lease_s: float = 60.0, read: bool = True
    ) -> Dispatch:
        """Lease exactly those of ``rows`` that are ready for ``consumer`` (in the order given); the others
        (held by another caller, consumed, or not ready) are left out. Never waits. With ``read=False`` the
        dispatch carries no columns: for a caller that holds the rows' values already (it just wrote them)."""
        self._check_lease_s(lease_s)
        with self._lock:
            c = self._consumer(consumer)
            table = self._table(iteration)
            slots, indices = self._rows(table, rows)
            now = self._clock()
            self._expire(now)
            inside = indices < table.width
            ready = np.zeros(len(slots), dtype=bool)
            ready[inside] = self._ready(table, c)[slots[inside], indices[inside]]
            if not ready.any():
                return Dispatch(consumer, iteration, None, None, (), {}, ())
            columns: _Columns = "values" if read else "none"
            return self._claim(table, c, slots[ready], indices[ready], now + lease_s, 1, False, None, None, columns)

    def _check_lease_s(self, lease_s: float) -> None:
        if not (0 < lease_s <= self.limits.max_lease_s):
            raise ExperienceInputError("lease_s", f"{lease_s} is outside (0, {self.limits.max_lease_s:g}] seconds")

    def _ready(self, table: Table, c: Consumer) -> npt.NDArray[np.bool_]:
        ready = ~table.peek(table.consumed, c.name) & ~table.peek(table.held, c.name) & ~_produced(table, c)
        for name in c.needs:
            ready &= table.written(name)
        return ready

    def _choose(self, table: Table, c: Consumer, want: int, groups: bool) -> tuple[Index, Index]:
        if min(table.rows_written(need) for need in c.needs) <= table.taken.get(c.name, 0):
            # Every row whose needs are written is held or consumed: none is ready.
            return np.empty(0, np.int64), np.empty(0, np.int64)
        ready = self._ready(table, c)
        if not groups:
            flat = np.flatnonzero(ready)[:want]
            return (flat // table.width).astype(np.int64), (flat % table.width).astype(np.int64)
        g = table.width
        if want % g:
            raise ExperienceInputError(
                "count",
                f"{want} is not a multiple of iteration {table.iteration}'s group_size {g}; "
                "with groups, ask for whole groups",
            )
        whole = np.flatnonzero(ready.all(axis=1))[: want // g].astype(np.int64)
        return np.repeat(whole, g), np.tile(np.arange(g, dtype=np.int64), len(whole))

    def _claim(
        self,
        table: Table,
        c: Consumer,
        slots: Index,
        indices: Index,
        expires_at: float,
        dp_size: int,
        groups: bool,
        balance_by: str | None,
        max_tokens: int | None,
        columns: _Columns = "values",
    ) -> Dispatch:
        cells = self._cell_bytes(table, slots, indices, c.needs) if columns != "none" else {}
        values = decode_columns(cells) if columns == "values" else cells
        if balance_by is not None:
            lengths = values[balance_by] if columns == "values" else decode_cells(cells[balance_by])
            parts = balanced_parts(lengths, dp_size, max_tokens)
        else:
            parts = even_parts(len(slots), dp_size, table.width if groups else 1)
        lease = Lease(
            secrets.token_hex(16),
            c.name,
            table.iteration,
            slots.astype(np.int32),
            indices.astype(np.int32),
            expires_at,
            "held",
        )
        with self._db.transaction():
            self._db.add_lease(lease)
        self._leases[lease.lease] = self._live[lease.lease] = lease
        table.mask(table.held, c.name)[slots, indices] = True
        table.take(c.name, len(slots))
        rows = tuple(zip(slots.tolist(), indices.tolist(), strict=True))
        return Dispatch(c.name, table.iteration, lease.lease, expires_at, rows, values, parts)

    def _expire(self, now: float) -> None:
        """Return the rows of every lease past its expiry to the pool."""
        late = [lease for lease in self._live.values() if lease.expires_at <= now]
        if not late:
            return
        with self._db.transaction():
            for lease in late:
                self._db.set_lease(lease.lease, state="expired", expires_at=lease.expires_at)
        for lease in late:
            lease.state = "expired"
            del self._live[lease.lease]
            table = self._tables[lease.iteration]  # a lease leaves _live when its table is dropped
            table.mask(table.held, lease.consumer)[lease.slots, lease.indices] = False
            table.take(lease.consumer, -len(lease.slots))
            self._maybe[lease.consumer].add(lease.iteration)

    def _lease(self, token: str, now: float) -> Lease:
        lease = self._leases.get(token)
        if lease is None:
            raise LeaseError(
                f"lease {token[:8]}… is unknown: it was never handed out by this store, or its table was dropped "
                "by retention; drop this result"
            )
        if lease.state == "held" and lease.expires_at <= now:
            self._expire(now)
        if lease.state == "expired":
            raise LeaseError(
                f"lease {token[:8]}… of consumer {lease.consumer!r} expired {now - lease.expires_at:.1f}s ago; "
                "its rows went back to the pool and may be held by another worker: drop this result (renew a "
                "lease before it expires for work that takes longer)"
            )
        return lease

    def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Collected:
        """Write a consumer's results for the rows of ``lease`` (one value per row, in dispatch order) and mark
        them consumed. Collecting the same values again is a no-op; a lease that expired is refused."""
        with self._lock:
            now = self._clock()
            held = self._lease(lease, now)
            c = self._consumer(held.consumer)
            extra = [name for name in columns if name not in c.produces]
            if extra:
                raise ExperienceInputError(
                    "columns",
                    f"consumer {c.name!r} does not produce {extra}; it produces {list(c.produces)} (register another "
                    "consumer, or another name, to write other columns)",
                )
            table = self._table(held.iteration)
            slots, indices = held.slots.astype(np.int64), held.indices.astype(np.int64)
            fresh = self._fresh_cells(table, slots, indices, columns)
            rows = tuple(zip(slots.tolist(), indices.tolist(), strict=True))
            collected = Collected(c.name, table.iteration, rows)
            if held.state == "collected":  # a retry: the values it repeats were checked just above
                if any(f.cells for f in fresh.values()):
                    with self._db.transaction():
                        stored = self._store_cells(table, fresh)
                    self._mark_written(table, fresh, stored)
                return collected
            # The results and the consumption in one transaction: a crash between them would leave rows whose
            # results are written but that are still leased, and then handed to another worker.
            with self._db.transaction():
                stored = self._store_cells(table, fresh)
                self._db.set_lease(lease, state="collected", expires_at=held.expires_at)
            self._mark_written(table, fresh, stored)
            held.state = "collected"
            del self._live[lease]
            table.mask(table.consumed, c.name)[slots, indices] = True
            table.mask(table.held, c.name)[slots, indices] = False
            return collected

    def collect_and_dispatch(
        self,
        lease: str,
        columns: Mapping[str, Sequence[Value]],
        count: int | None = None,
        *,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[Collected, Dispatch]:
        """:meth:`collect`, then :meth:`dispatch` of up to ``count`` rows for the same consumer: a worker's next rows
        with its results (over HTTP, one request). A refused collection dispatches nothing."""
        collected = self.collect(lease, columns)
        return collected, self.dispatch(collected.consumer, count, lease_s=lease_s, wait_s=wait_s)

    def collect_many(
        self, consumer: str, results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]]
    ) -> tuple[Collected | LeaseError, ...]:
        """:meth:`collect` of each ``(lease, columns)`` of ``consumer``, in one transaction. A lease the store
        refuses (unknown or expired) is answered with its :class:`LeaseError` in its place, and the others are
        collected; any other error refuses them all, and nothing is written."""
        check_count("collections", len(results), 0, self.limits.max_tables_per_call)
        with self._lock:  # refused here, a bad request costs no rollback of the batch below
            self._consumer(consumer)
            for n, (lease, _) in enumerate(results):
                held = self._leases.get(lease)
                if held is not None and held.consumer != consumer:
                    raise ExperienceInputError(
                        f"collections[{n}]",
                        f"lease {lease[:8]}… belongs to consumer {held.consumer!r}, not {consumer!r}",
                    )
        outcomes: list[Collected | LeaseError] = []
        with self.batch():
            for lease, columns in results:
                try:
                    outcomes.append(self.collect(lease, columns))
                except LeaseError as exc:  # raised before the lease's rows are touched
                    outcomes.append(exc)
        return tuple(outcomes)

    def collect_and_dispatch_many(
        self,
        consumer: str,
        results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]],
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[tuple[Collected | LeaseError, ...], tuple[Dispatch, ...]]:
        """:meth:`collect_many`, then :meth:`dispatch_many` for the same consumer: a worker's next rows with its
        results (over HTTP, one request)."""
        outcomes = self.collect_many(consumer, results)
        return outcomes, self.dispatch_many(consumer, count, tables=tables, lease_s=lease_s, wait_s=wait_s)

    def renew(self, lease: str, lease_s: float = 60.0) -> float:
        """Extend a live lease to ``lease_s`` seconds from now; returns its new expiry."""
        self._check_lease_s(lease_s)
        with self._lock:
            now = self._clock()
            held = self._lease(lease, now)
            if held.state == "collected":
                raise LeaseError(f"lease {lease[:8]}… was already collected; there is nothing left to renew")
            expires_at = now + lease_s
            with self._db.transaction():
                self._db.set_lease(lease, state="held", expires_at=expires_at)
            held.expires_at = expires_at
            return expires_at

    def consumption(self, consumer: str, iteration: int) -> Consumption:
        with self._lock:
            c = self._consumer(consumer)
            table = self._table(iteration)
            self._expire(self._clock())
            held = table.peek(table.held, consumer)
            return Consumption(
                consumer,
                iteration,
                table.rows,
                int((table.peek(table.consumed, consumer) | (_produced(table, c) & ~held)).sum()),
                int(held.sum()),
                int(self._ready(table, c).sum()),
            )

    def claimed(self, consumer: str, iteration: int, rows: Sequence[RowKey]) -> int:
        """How many of ``rows`` ``consumer`` holds under a live lease or has consumed."""
        with self._lock:
            table = self._table(iteration)
            slots, indices = self._rows(table, rows)
            self._expire(self._clock())
            inside = indices < table.width
            s, k = slots[inside], indices[inside]
            taken = table.peek(table.consumed, consumer)[s, k] | table.peek(table.held, consumer)[s, k]
            return int(taken.sum())

    def all_consumed(self, consumer: str, iteration: int) -> bool:
        """Whether ``consumer`` has collected every row of ``iteration``'s table."""
        return self.consumption(consumer, iteration).all_consumed


def _produced(table: Table, c: Consumer) -> npt.NDArray[np.bool_]:
    """Rows where a column ``c`` produces is written already (by a writer, or by another consumer of that
    column): its result could not be collected there, so they are not its work, and they count as consumed."""
    produced = np.zeros((table.slots, table.width), dtype=bool)
    for name in c.produces:
        produced |= table.written(name)
    return produced


def _looked(wait_s: float, look: Callable[[], _Found], empty: Callable[[_Found], bool]) -> _Found:
    """``look()`` until what it finds is not ``empty`` or ``wait_s`` seconds passed (looking again every few
    milliseconds, holding nothing meanwhile): its last outcome."""
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s <= 3600:
        raise ExperienceInputError("wait_s", f"{wait_s!r} is not a number of seconds in 0..3600")
    deadline = time.monotonic() + wait_s
    while True:
        found = look()
        left = deadline - time.monotonic()
        if not empty(found) or left <= 0:
            return found
        time.sleep(min(left, _WAIT_LOOK_S))
