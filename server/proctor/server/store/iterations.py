"""Sampled iterations: their batches, an adaptive stage's decisions, the stage transitions, and the
latest iteration to serve each sample id."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proctor.server.state.rows import (
    DecisionRow,
    IterationRow,
    TransitionRecord,
)
from proctor.server.store.connection import _KEYS_PER_STATEMENT, _ROWS_PER_STATEMENT, StateConnection, _parts

__all__ = ["IterationQueries"]


# How often the ids that new iterations served are written to the `served` index. Each id lands on a random page
# of that table: written a commit at a time they were two thirds of the pages a /sample put in the WAL, where a
# few seconds' worth together touch each page once.
SERVED_INDEX_EVERY_S = 2.0
_PENDING_FROM = "served_pending_from"


class IterationQueries(StateConnection):
    """What was served: each iteration's batch and decision, and the transitions decided for it.

    The ``served`` index (the latest iteration to serve each sample id) is written every
    ``served_index_every_s``, not with each iteration: the ids recorded meanwhile are held in memory, and
    ``meta`` holds the lowest iteration among them, so that opening the state after a crash indexes the
    iterations from there on again (their batches are stored with them). An iteration below one already
    recorded (a gap filled late) is indexed at once instead, so that the mark never reaches back past the
    iterations recorded since the last write.
    """

    def _opened(self) -> None:
        super()._opened()
        self._unindexed: dict[str, int] = {}
        self._unindexed_from: int | None = None
        self._indexed_at = time.monotonic()
        self.served_index_every_s = SERVED_INDEX_EVERY_S
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (_PENDING_FROM,)).fetchone()
        if row is not None:
            # A server that stopped without writing its held ids: index its iterations from the mark on again.
            ids: dict[str, int] = {}
            rows = self._db.execute("SELECT iteration, samples FROM iterations WHERE iteration >= ?", (int(row[0]),))
            for iteration, samples in rows.fetchall():
                _latest(ids, ((s["sample_id"], int(iteration)) for s in json.loads(samples)))
            with self._tx():
                self._index(ids)
        self._highest = self.last_iteration()

    def _index(self, ids: dict[str, int]) -> None:
        """Write ``ids`` to the ``served`` index and drop the mark of held ids, within the open transaction."""
        self._write_served(ids)
        self._db.defer("DELETE FROM meta WHERE key = ?", (_PENDING_FROM,))

    def _write_served(self, ids: Mapping[str, int]) -> None:
        """Write ``ids`` to the ``served`` index, within the open transaction."""
        for part in _parts(sorted(ids.items()), _ROWS_PER_STATEMENT):
            values, params = self._db.rows(("text", "bigint"), part)
            self._db.defer(
                f"INSERT INTO served (sample_id, iteration) {values} ON CONFLICT (sample_id) DO UPDATE"
                " SET iteration = excluded.iteration WHERE excluded.iteration > served.iteration",
                params,
            )

    def close(self) -> None:
        if self._unindexed:
            # A database gone keeps the mark in meta: the next open indexes those iterations.
            with contextlib.suppress(*self._db.errors), self._tx():
                self._index(self._unindexed)
        super().close()

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
        served: dict[str, int] = {}
        late: dict[str, int] = {}  # the ids of iterations below one already recorded: indexed at once
        lowest, highest = self._unindexed_from, self._highest
        index = time.monotonic() - self._indexed_at >= self.served_index_every_s
        with self._tx():
            for row, transitions, samples_json in entries:
                self._db.defer(
                    "INSERT INTO iterations (iteration, batch_size, stage, samples, created_at) VALUES (?, ?, ?, ?, ?)",
                    (row.iteration, row.batch_size, row.stage, samples_json or json.dumps(row.samples), now),
                )
                ids = ((s["sample_id"], row.iteration) for s in row.samples)
                if highest is not None and row.iteration < highest:
                    _latest(late, ids)
                else:  # held: in order, so the first held is the lowest
                    _latest(served, ids)
                    if lowest is None:
                        lowest = row.iteration
                    highest = row.iteration
                self._insert_transitions(transitions, now)
                if row.decision is not None:
                    self._record_decision(row.iteration, row.stage, row.decision)
            if late:
                self._write_served(late)
            if index:
                self._index(_latest(dict(self._unindexed), served.items()))
            elif lowest != self._unindexed_from:
                self._db.defer(
                    "INSERT INTO meta (key, value) VALUES (?, ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (_PENDING_FROM, str(lowest)),
                )
            self._db.after_commit(lambda: self._indexed(served, lowest, highest, index))

    def _indexed(self, served: dict[str, int], lowest: int | None, highest: int | None, index: bool) -> None:
        # Committed. A read on another thread takes the held ids before the table (latest_served), so they are let
        # go of only once indexed, as a new dict; added in place meanwhile, a key at a time.
        self._highest = highest
        if index:
            self._unindexed, self._unindexed_from = {}, None
            self._indexed_at = time.monotonic()
        else:
            _latest(self._unindexed, served.items())
            self._unindexed_from = lowest

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

    def record_refill(
        self, iteration: int, round_: int, detail: dict[str, Any], samples_json: str, new_ids: Sequence[str]
    ) -> None:
        """Store a refill round of ``iteration`` (what it replaced, ``detail``) with the step's samples, the
        replacing ones appended (``samples_json``), atomically; the replacing ``new_ids`` are indexed as served
        by the step."""
        with self._tx():
            self._db.defer(
                "INSERT INTO refills (iteration, round, detail, created_at) VALUES (?, ?, ?, ?)",
                (iteration, round_, json.dumps(detail), time.time()),
            )
            self._db.defer("UPDATE iterations SET samples = ? WHERE iteration = ?", (samples_json, iteration))
            for part in _parts(sorted(set(new_ids)), _ROWS_PER_STATEMENT):
                values, params = self._db.rows(("text", "bigint"), [(sid, iteration) for sid in part])
                self._db.defer(
                    f"INSERT INTO served (sample_id, iteration) {values} ON CONFLICT (sample_id) DO UPDATE"
                    " SET iteration = excluded.iteration WHERE excluded.iteration > served.iteration",
                    params,
                )

    def refills(self, iteration: int) -> list[tuple[int, dict[str, Any]]]:
        """The refill rounds recorded for ``iteration``, as ``(round, detail)``, in round order."""
        rows = self._reader.execute(
            "SELECT round, detail FROM refills WHERE iteration = ? ORDER BY round", (iteration,)
        ).fetchall()
        return [(int(r), json.loads(d)) for r, d in rows]

    def refill_counts(self, first: int) -> dict[int, tuple[int, int]]:
        """Per iteration from ``first`` on, its refill rounds that replaced groups, and the groups they replaced."""
        out: dict[int, tuple[int, int]] = {}
        for iteration, detail in self._db.execute(
            "SELECT iteration, detail FROM refills WHERE iteration >= ? ORDER BY iteration, round", (first,)
        ):
            groups = len(json.loads(detail)["replaced"])
            if groups:
                rounds, replaced = out.get(int(iteration), (0, 0))
                out[int(iteration)] = (rounds + 1, replaced + groups)
        return out

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
        # The held ids before the table: the writer indexes them, commits, and only then lets go of them.
        unindexed = self._unindexed
        ids = sorted(set(sample_ids))
        out = {sid: unindexed[sid] for sid in ids if sid in unindexed}
        for part in _parts(ids, _KEYS_PER_STATEMENT):
            marks = ",".join("?" * len(part))
            for sid, iteration in self._reader.execute(
                f"SELECT sample_id, iteration FROM served WHERE sample_id IN ({marks})", part
            ):
                out[sid] = max(int(iteration), out.get(sid, -1))
        return out


def _latest(into: dict[str, int], served: Iterable[tuple[str, int]]) -> dict[str, int]:
    """``into`` with each ``(sample id, iteration)`` of ``served`` at the later of the two iterations (changed in
    place, a key at a time)."""
    for sid, iteration in served:
        if into.get(sid, -1) < iteration:
            into[sid] = iteration
    return into
