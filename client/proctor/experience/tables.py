"""The experience store's tables in memory: where each written cell of a column is (its chunk, and its position
there), what each consumer holds and has consumed, and what a caller is told of a table (:class:`TableInfo`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from proctor.experience.persistence import StoredTable

__all__ = ["Column", "FreshCells", "Index", "RowKey", "Table", "TableInfo", "age_of", "iteration_of"]

RowKey = tuple[int, int]
"""``(slot, index)``: a prompt's slot in the step's batch, and which of its completions."""

Index = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TableInfo:
    """What a caller is told of a table: its shape, and how many rows of each column are written."""

    iteration: int
    slots: int
    group_size: int | None
    """Completions per prompt; None until a writer that knows it opens the table with it."""
    written: Mapping[str, int]
    """Rows whose cell is written so far, per column."""
    width: int = 0
    """Rows per slot so far: the group size, or one past the highest completion index written."""

    @property
    def rows(self) -> int:
        return self.slots * (self.group_size if self.group_size is not None else self.width)


@dataclass(slots=True)
class Column:
    """Where each written cell of one column is: its chunk (0 when not written) and its position there.
    A column written per slot holds one cell per slot, shared by the slot's rows. The arrays may be larger
    than the table (room to grow into)."""

    per_slot: bool
    chunk: Index
    pos: npt.NDArray[np.int32]
    count: int = 0
    """Cells written."""

    def written(self, slots: int, width: int) -> npt.NDArray[np.bool_]:
        """The written rows, as a ``slots × width`` mask."""
        if self.per_slot:
            return np.repeat((self.chunk[:slots] != 0)[:, None], width, axis=1)
        found: npt.NDArray[np.bool_] = self.chunk[:slots, :width] != 0
        return found


@dataclass(slots=True)
class Table:
    iteration: int
    slots: int
    group_size: int | None
    width: int
    """Rows per slot so far: the group size, or (while it is not set) one past the highest index written."""
    columns: dict[str, Column] = field(default_factory=dict)
    consumed: dict[str, npt.NDArray[np.bool_]] = field(default_factory=dict)
    held: dict[str, npt.NDArray[np.bool_]] = field(default_factory=dict)
    taken: dict[str, int] = field(default_factory=dict)
    """Rows each consumer holds or has consumed."""
    room: tuple[int, int] = (0, 0)
    """The arrays' shape: at least ``slots × width``, doubled as the table grows so growing costs little."""

    def __post_init__(self) -> None:
        self.room = (self.slots, self.width)

    @property
    def rows(self) -> int:
        return self.slots * self.width

    def stored(self) -> StoredTable:
        return StoredTable(self.iteration, self.slots, self.group_size)

    def grow(self, slots: int, width: int) -> None:
        """Make room for ``slots × width`` rows; new rows start unwritten, unconsumed and unheld."""
        slots, width = max(slots, self.slots), max(width, self.width)
        have_s, have_w = self.room
        if slots > have_s or width > have_w:
            room = (
                max(slots, 2 * have_s) if slots > have_s else have_s,
                max(width, 2 * have_w) if width > have_w else have_w,
            )
            for column in self.columns.values():
                shape = room[:1] if column.per_slot else room
                column.chunk = _grown(column.chunk, shape)
                column.pos = _grown(column.pos, shape)
            for masks in (self.consumed, self.held):
                for name, mask in masks.items():
                    masks[name] = _grown(mask, room)
            self.room = room
        self.slots, self.width = slots, width

    def take(self, consumer: str, rows: int) -> None:
        self.taken[consumer] = self.taken.get(consumer, 0) + rows

    def mask(self, masks: dict[str, npt.NDArray[np.bool_]], name: str) -> npt.NDArray[np.bool_]:
        """The mask of ``name`` (a view of the table's rows), created (all False) on first use: only for a
        change about to be made, so that names a caller merely asks about take no memory."""
        found = masks.get(name)
        if found is None:
            found = masks[name] = np.zeros(self.room, dtype=bool)
        return found[: self.slots, : self.width]

    def peek(self, masks: dict[str, npt.NDArray[np.bool_]], name: str) -> npt.NDArray[np.bool_]:
        """The mask of ``name`` to read (all False when there is none); never stored."""
        found = masks.get(name)
        if found is None:
            return np.zeros((self.slots, self.width), dtype=bool)
        return found[: self.slots, : self.width]

    def written(self, name: str) -> npt.NDArray[np.bool_]:
        column = self.columns.get(name)
        if column is None:
            return np.zeros((self.slots, self.width), dtype=bool)
        return column.written(self.slots, self.width)

    def rows_written(self, name: str) -> int:
        """Rows whose cell of ``name`` is written."""
        column = self.columns.get(name)
        if column is None:
            return 0
        return column.count * self.width if column.per_slot else column.count

    def column(self, name: str, per_slot: bool) -> Column:
        found = self.columns.get(name)
        if found is None:
            shape = (self.room[0],) if per_slot else self.room
            found = self.columns[name] = Column(per_slot, np.zeros(shape, np.int64), np.zeros(shape, np.int32))
        return found


@dataclass(frozen=True, slots=True)
class FreshCells:
    """One column's cells of a write that are not written yet, encoded."""

    slots: Index
    indices: Index | None
    cells: list[bytes]


def _grown(array: npt.NDArray[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """``array`` in the top-left corner of zeros of ``shape`` (``np.pad``'s result, without its general path:
    a table grows as its first completions are written, in a /grade's transaction)."""
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown


def age_of(iteration: int) -> tuple[int, bool]:
    """Tables in the order of the steps they belong to: a step's table, then its table of loose rows."""
    return (iteration, False) if iteration >= 0 else (-iteration - 1, True)


def iteration_of(age: tuple[int, bool]) -> int:
    step, loose = age
    return -step - 1 if loose else step
