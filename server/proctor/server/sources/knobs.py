"""What the procedural sources of the optional extras (reasoning-gym, reasoning-core) share: the knobs of a
generator's config dataclass that a curriculum may set, and how a generator's refusal is quoted."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

__all__ = ["REQUIRED", "config_knobs", "reason"]


class _Required:
    def __repr__(self) -> str:
        return "(required)"


REQUIRED = _Required()
"""The default of a knob that has none: the curriculum must set it."""


def config_knobs(config_cls: type, reserved: Collection[str]) -> dict[str, Any]:
    """A config dataclass's fields and their defaults (:data:`REQUIRED` where there is none), leaving out
    ``reserved``: those proctor sets itself."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name in reserved:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = REQUIRED
    return out


def reason(exc: BaseException) -> str:
    """What an exception says, or its type's name when it says nothing."""
    text = str(exc)
    return text if text else type(exc).__name__
