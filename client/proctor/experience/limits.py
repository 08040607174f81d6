"""What one call to the experience store may ask for: its bounds, and the checks of the counts and names a
caller sends it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proctor.experience.errors import ExperienceInputError

__all__ = ["MAX_NAME", "NAME_CHARS", "ExperienceLimits", "check_count", "check_name"]

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")
"""What a consumer's or a column's name is made of."""
MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class ExperienceLimits:
    """Bounds on what one call may ask for: each call's work is bounded by them."""

    max_slots: int = 65_536
    max_group_size: int = 4_096
    max_rows: int = 1 << 20
    """Rows in one table (slots × group_size)."""
    max_rows_per_call: int = 65_536
    max_tables_per_call: int = 64
    """Tables one :meth:`ExperienceStore.dispatch_many` takes rows of, and leases one ``collect_many`` collects."""
    max_columns: int = 64
    max_lease_s: float = 86_400.0


def check_count(field: str, value: Any, low: int, high: int) -> None:
    """Refuse ``value`` unless it is an integer in ``low..high``, naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExperienceInputError(field, f"{value!r} is not an integer")
    if not low <= value <= high:
        raise ExperienceInputError(field, f"{value} is outside {low}..{high}")


def check_name(field: str, name: Any) -> None:
    """Refuse ``name`` unless it is a name (:data:`NAME_CHARS`, 1 to :data:`MAX_NAME` of them), naming ``field``."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not set(name) <= NAME_CHARS:
        raise ExperienceInputError(
            field, f"{name!r} is not a name: use 1 to {MAX_NAME} of lower-case letters, digits, '_', '-' and '.'"
        )
