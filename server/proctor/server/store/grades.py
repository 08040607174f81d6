"""Grades: stored once per completion, and folded into their group's and their record's statistics in
the transaction that stores them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proctor.server.state.items import NEW_GROUP, GroupState, ItemState, ItemTracking, fold_grade
from proctor.server.state.rows import (
    GradeKey,
    GradeOutcome,
    GradeRow,
    GroupChange,
    StoredGrades,
)
from proctor.server.store.connection import _KEYS_PER_STATEMENT, _ROWS_PER_STATEMENT, StateConnection, _parts

__all__ = ["GRADED_KEPT", "GradeQueries"]

GRADED_KEPT = 65_536  # iterations the serving store remembers having grades (a few MiB); older ones are looked up

# Per group of grades: the error-free ones, the errors, the error-free rewards' sum.
_GRADE_SUMS = (
    "SUM(CASE WHEN error IS NULL THEN 1 ELSE 0 END), SUM(CASE WHEN error IS NULL THEN 0 ELSE 1 END),"
    " SUM(CASE WHEN error IS NULL THEN reward END)"
)

# The keys that statements take sets of, with their PostgreSQL types (see Database.rows and Database.lookup).
_GRADE_KEY = (
    ("iteration", "bigint"),
    ("sample_id", "text"),
    ("slot", "bigint"),
    ("completion_index", "bigint"),
    ("completion_sha", "text"),
)
_GROUP_KEY = (("iteration", "bigint"), ("sample_id", "text"), ("slot", "bigint"))
_RECORD_KEY = (("source", "text"), ("key", "bigint"))
_GRADE_TYPES = tuple(t for _, t in _GRADE_KEY)
_GROUP_TYPES = tuple(t for _, t in _GROUP_KEY)
_RECORD_TYPES = tuple(t for _, t in _RECORD_KEY)
# What the look-ups read: the key, then the stored values.
_GRADE_COLUMNS = (
    *(n for n, _ in _GRADE_KEY),
    *("stage", "source", "reward", "components", "error", "details"),
)
_GROUP_COLUMNS = (*(n for n, _ in _GROUP_KEY), "n", "mean", "m2")
_ITEM_COLUMNS = (
    *(n for n, _ in _RECORD_KEY),
    *("passes", "fails", "groups", "streak", "streak_before", "last_iteration", "last_slot", "served_epoch"),
)


class GradeQueries(StateConnection):
    """Grades and the per-record and per-group statistics they fold into."""

    # The store that holds the state is the only one that stores grades: an iteration above the highest one
    # graded when it opened has grades only if it stored them, which it remembers. A store that only reads (a
    # standby's, which never opens as this one does) asks the database every time.
    _graded_through: int | None = None
    _graded_here: set[int]

    def _opened(self) -> None:
        super()._opened()
        (highest,) = self._db.execute("SELECT MAX(iteration) FROM grades").fetchone()
        self._graded_through = -1 if highest is None else int(highest)
        self._graded_here = set()

    def _remember_graded(self, iterations: set[int]) -> None:
        """Add to the iterations known to have grades; past ``GRADED_KEPT`` of them, the older half is asked of
        the database from then on, so that memory stays bounded over a run of any length."""
        self._graded_here.update(iterations)
        if len(self._graded_here) <= GRADED_KEPT:
            return
        floor = sorted(self._graded_here)[len(self._graded_here) // 2]
        assert self._graded_through is not None  # only the serving store, which has a bound, remembers
        # The bound first, the smaller set after: a reader that takes the set first, then the bound, never
        # misses an iteration (see graded_iterations).
        self._graded_through = max(floor, self._graded_through)
        self._graded_here = {i for i in self._graded_here if i > floor}

    def graded_iterations(self, iterations: Iterable[int]) -> set[int]:
        """Those of ``iterations`` with at least one stored grade: from memory, or the unique key's index (a
        statement per few hundred iterations) for those graded before the store opened."""
        wanted = set(iterations)
        out: set[int] = set()
        if self._graded_through is not None:
            # The store's thread changes both meanwhile, each in one operation under the interpreter lock.
            here = self._graded_here
            through = self._graded_through
            out = wanted & here
            wanted = {i for i in wanted - out if i <= through}
        for part in _parts(sorted(wanted), _KEYS_PER_STATEMENT):
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

    def slot_rewards(self, iteration: int, slots: Sequence[int]) -> dict[int, dict[int, float | None]]:
        """The stored rewards of ``slots`` of a step, by slot then completion index (None: its grading failed);
        the first grade of a completion index counts."""
        out: dict[int, dict[int, float | None]] = {}
        for part in _parts(sorted(set(slots)), _KEYS_PER_STATEMENT):
            marks = ",".join("?" * len(part))
            for slot, index, reward, error in self._reader.execute(
                f"SELECT slot, completion_index, reward, error FROM grades WHERE iteration = ? AND slot IN ({marks})"
                " ORDER BY seq",
                (iteration, *part),
            ):
                out.setdefault(int(slot), {}).setdefault(int(index), None if error is not None else float(reward))
        return out

    def records(self, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], ItemState]:
        """The stored state of the records ``(source, key)`` that have one."""
        out: dict[tuple[str, int], ItemState] = {}
        for part in _parts(sorted(set(keys)), _KEYS_PER_STATEMENT):
            rows = self._reader.execute(*self._reader.lookup("items", _RECORD_KEY, _ITEM_COLUMNS, part))
            for source, key, passes, fails, groups, streak, before, iteration, slot, served in rows:
                out[(source, key)] = ItemState(passes, fails, groups, streak, before, (iteration, slot), served)
        return out

    def find_grades(self, keys: Iterable[GradeKey]) -> dict[GradeKey, GradeRow]:
        """The stored grades of ``keys`` (keys without one are absent), a statement per few hundred keys."""
        out: dict[GradeKey, GradeRow] = {}
        for part in _parts(list(keys), _KEYS_PER_STATEMENT):
            rows = self._reader.execute(*self._reader.lookup("grades", _GRADE_KEY, _GRADE_COLUMNS, part))
            for *key, stage, source, reward, components, error, details in rows:
                k: GradeKey = (key[0], key[1], key[2], key[3], key[4])
                out[k] = GradeRow(k, stage, source, reward, json.loads(components), error, json.loads(details or "{}"))
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
        tracking = self._tracking
        # The stored state of each group and record an error-free grade may fold into is read with the inserts,
        # in the same round trip on PostgreSQL; a grade the inserts do not store folds into nothing.
        foldable = [r for r in rows if r.error is None]
        group_keys = list(dict.fromkeys((r.key[0], r.key[1], r.key[2]) for r in foldable))
        record_keys = list(
            dict.fromkeys((r.source, _record_key(r.key[1])) for r in foldable if r.source in tracking.finite)
        )
        with self._tx():
            # Which rows the upsert inserted, and which errors it replaced: PostgreSQL says so (a row version
            # no transaction has replaced, xmax 0, is new). On SQLite, one writer in a transaction: a row whose
            # seq is above the largest before it was inserted now.
            before = 0
            if not postgresql:
                (before,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM grades").fetchone()
            new, after = ("xmax = 0", []) if postgresql else ("seq > ?", [before])
            inserts: list[tuple[str, list[Any]]] = []
            for part in _parts(list(rows), _ROWS_PER_STATEMENT):
                values, params = self._db.rows(
                    (*_GRADE_TYPES, "bigint", "text", "double precision", "text", "text", "text", "double precision"),
                    [
                        (*r.key, r.stage, r.source, r.reward, json.dumps(r.components), r.error, _details(r), now)
                        for r in part
                    ],
                )
                inserts.append(
                    (
                        "INSERT INTO grades (iteration, sample_id, slot, completion_index, completion_sha, stage,"
                        f" source, reward, components, error, details, created_at) {values}"
                        " ON CONFLICT (iteration, sample_id, slot, completion_index, completion_sha) DO UPDATE SET"
                        " stage = excluded.stage, source = excluded.source, reward = excluded.reward,"
                        " components = excluded.components, error = excluded.error, details = excluded.details,"
                        " created_at = excluded.created_at"
                        " WHERE grades.error IS NOT NULL"
                        f" RETURNING {new}, iteration, sample_id, slot, completion_index, completion_sha",
                        params + after,
                    )
                )
            group_reads = [
                self._db.lookup("groups", _GROUP_KEY, _GROUP_COLUMNS, part)
                for part in _parts(group_keys, _KEYS_PER_STATEMENT)
            ]
            record_reads = [
                self._db.lookup("items", _RECORD_KEY, _ITEM_COLUMNS, part)
                for part in _parts(record_keys, _KEYS_PER_STATEMENT)
            ]
            results = self._db.fetch_together([*inserts, *group_reads, *record_reads])
            for returned in results[: len(inserts)]:
                for inserted, *key in returned:
                    written[(key[0], key[1], key[2], key[3], key[4])] = "inserted" if inserted else "replaced_error"
            groups = dict.fromkeys(group_keys, NEW_GROUP)
            for found in results[len(inserts) : len(inserts) + len(group_reads)]:
                for iteration, sample_id, slot, n, mean, m2 in found:
                    groups[(iteration, sample_id, slot)] = GroupState(n, mean, m2)
            items = {k: ItemState() for k in record_keys}
            for found in results[len(inserts) + len(group_reads) :]:
                for source, record, *fields in found:
                    passes, fails, n_groups, streak, streak_before, last_iteration, last_slot, served = fields
                    items[(source, record)] = ItemState(
                        passes, fails, n_groups, streak, streak_before, (last_iteration, last_slot), served
                    )
            folded = self._fold([r for r in foldable if r.key in written], groups, items)
            if self._graded_through is not None:
                graded = {r.key[0] for r in rows}
                self._db.after_commit(lambda: self._remember_graded(graded))
        return StoredGrades([written.get(r.key, "exists") for r in rows], *folded)

    def _fold(
        self,
        rows: Sequence[GradeRow],
        stored_groups: Mapping[tuple[int, str, int], GroupState],
        stored_items: Mapping[tuple[str, int], ItemState],
    ) -> tuple[list[tuple[str, int, ItemState]], list[GroupChange]]:
        """Fold ``rows`` into their groups and records (whose stored states are given) and write those."""
        tracking = self._tracking
        first: dict[tuple[int, str, int], GroupState] = {}  # each group's state before, in the order first met
        groups: dict[tuple[int, str, int], GroupState] = {}
        source_of: dict[tuple[int, str, int], str] = {}
        items: dict[tuple[str, int], ItemState] = {}
        for r in rows:
            gkey = (r.key[0], r.key[1], r.key[2])
            if gkey not in groups:
                groups[gkey] = first[gkey] = stored_groups[gkey]
                source_of[gkey] = r.source
            group = groups[gkey]
            updated = groups[gkey] = group.add(r.reward)
            if r.source in tracking.finite:
                ikey = (r.source, _record_key(r.key[1]))
                passed = r.reward >= tracking.pass_thresholds.get(r.source, 1.0)
                item = items[ikey] if ikey in items else stored_items[ikey]
                items[ikey] = fold_grade(item, group, updated, (r.key[0], r.key[2]), passed, tracking.decay)
        group_keys, record_keys = list(groups), list(items)
        for gpart in _parts(group_keys, _ROWS_PER_STATEMENT):
            values, params = self._db.rows(
                (*_GROUP_TYPES, "bigint", "double precision", "double precision"),
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
                    *_RECORD_TYPES,
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
        changes = [GroupChange(k[0], k[1], k[2], source_of[k], first[k], groups[k]) for k in group_keys]
        return [(source, key, items[(source, key)]) for source, key in record_keys], changes


def _record_key(sample_id: str) -> int:
    return int(sample_id.rsplit(":", 1)[1])


def _details(row: GradeRow) -> str | None:
    # NULL for the grades of graders that say nothing but a score: nearly all of them.
    return json.dumps(row.details) if row.details else None
