"""The curricula that ship with proctor, installed as package data."""

from __future__ import annotations

from pathlib import Path

__all__ = ["builtin_curricula", "builtin_path"]

_HERE = Path(__file__).resolve().parent


def builtin_curricula() -> dict[str, Path]:
    """Names of the shipped curricula mapped to their YAML files."""
    return {p.stem: p for p in sorted(_HERE.glob("*.yaml"))}


def builtin_path(name: str = "arithmetic") -> Path:
    """Path of a shipped curriculum; ``arithmetic`` is the default the server falls back to."""
    try:
        return builtin_curricula()[name]
    except KeyError:
        known = ", ".join(builtin_curricula()) or "none"
        raise FileNotFoundError(f"no shipped curriculum named {name!r}; shipped: {known}") from None
