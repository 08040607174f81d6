"""The experience store's exceptions: one root, and a class per outcome a caller handles differently.

The in-process store raises them directly; over HTTP the dataserver answers with their ``code`` (and a status
its HTTP layer chooses), and the experience client raises the same class again, so code written against one face
works against the other. The root derives from ``proctor.errors.ProctorError``, as every error of proctor does.
"""

from __future__ import annotations

from proctor.errors import ProctorError

__all__ = [
    "CellConflictError",
    "CellsMissingError",
    "ExperienceError",
    "ExperienceInputError",
    "LeaseError",
    "ShapeConflictError",
    "UnknownConsumerError",
    "UnknownIterationError",
    "error_class",
]


class ExperienceError(ProctorError):
    """Every error of the experience store. ``code`` names the class on the wire."""

    code = "experience_error"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class ExperienceInputError(ExperienceError, ValueError):
    """A value the store cannot accept: a row outside the table, a column of the wrong length, a bad name."""

    code = "invalid"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class UnknownIterationError(ExperienceError, LookupError):
    """The iteration has no table: it was never opened, or retention dropped it."""

    code = "unknown_iteration"


class UnknownConsumerError(ExperienceError, LookupError):
    """The consumer was never registered."""

    code = "unknown_consumer"


class ShapeConflictError(ExperienceError):
    """An iteration opened again with another shape, or a consumer registered again with other columns."""

    code = "shape_conflict"


class CellConflictError(ExperienceError):
    """A cell written again with a different value: each column is written once per row."""

    code = "cell_conflict"


class CellsMissingError(ExperienceError):
    """A read by index of cells that are not written yet (reads by index never wait)."""

    code = "cells_missing"


class LeaseError(ExperienceError):
    """A result for rows the writer does not hold: the lease is unknown, expired, or already collected with
    other values."""

    code = "lease"


_BY_CODE: dict[str, type[ExperienceError]] = {
    cls.code: cls
    for cls in (
        ExperienceError,
        UnknownIterationError,
        UnknownConsumerError,
        ShapeConflictError,
        CellConflictError,
        CellsMissingError,
        LeaseError,
    )
}


def error_class(code: str) -> type[ExperienceError] | None:
    """The exception class a wire ``code`` stands for (``invalid`` is rebuilt by the caller: it has a field)."""
    return _BY_CODE.get(code)
