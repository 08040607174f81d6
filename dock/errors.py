"""The experience store's exceptions: one root, and a class per outcome a caller handles differently.

The in-process store raises them directly; over HTTP the dataserver answers with their status and ``code``,
and the dock client raises the same class again, so code written against one face works against the other.
"""

from __future__ import annotations

__all__ = [
    "CellConflictError",
    "CellsMissingError",
    "DockError",
    "DockInputError",
    "LeaseError",
    "ShapeConflictError",
    "UnknownConsumerError",
    "UnknownIterationError",
    "error_class",
]


class DockError(Exception):
    """Every error of the experience store. ``code`` names the class on the wire; ``status`` is its HTTP status."""

    code = "dock_error"
    status = 400

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class DockInputError(DockError, ValueError):
    """A value the store cannot accept: a row outside the table, a column of the wrong length, a bad name."""

    code = "invalid"
    status = 422

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class UnknownIterationError(DockError, LookupError):
    """The iteration has no table: it was never opened, or retention dropped it."""

    code = "unknown_iteration"
    status = 404


class UnknownConsumerError(DockError, LookupError):
    """The consumer was never registered."""

    code = "unknown_consumer"
    status = 404


class ShapeConflictError(DockError):
    """An iteration opened again with another shape, or a consumer registered again with other columns."""

    code = "shape_conflict"
    status = 409


class CellConflictError(DockError):
    """A cell written again with a different value: each column is written once per row."""

    code = "cell_conflict"
    status = 409


class CellsMissingError(DockError):
    """A read by index of cells that are not written yet (reads by index never wait)."""

    code = "cells_missing"
    status = 409


class LeaseError(DockError):
    """A result for rows the writer does not hold: the lease is unknown, expired, or already collected with
    other values."""

    code = "lease"
    status = 409


_BY_CODE: dict[str, type[DockError]] = {
    cls.code: cls
    for cls in (
        DockError,
        UnknownIterationError,
        UnknownConsumerError,
        ShapeConflictError,
        CellConflictError,
        CellsMissingError,
        LeaseError,
    )
}


def error_class(code: str) -> type[DockError] | None:
    """The exception class a wire ``code`` stands for (``invalid`` is rebuilt by the caller: it has a field)."""
    return _BY_CODE.get(code)
