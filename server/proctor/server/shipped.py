"""The curricula that ship with proctor: the YAML files of ``curricula/``, installed as ``proctor.curricula``."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["builtin_curricula", "builtin_path"]


def _folder() -> Path:
    # A wheel and an editable install both put the package on disk; a zipped one is not supported.
    return Path(str(files("proctor.curricula")))


def builtin_curricula() -> dict[str, Path]:
    """Names of the shipped curricula mapped to their YAML files."""
    return {p.stem: p for p in sorted(_folder().glob("*.yaml"))}


def builtin_path(name: str = "arithmetic") -> Path:
    """Path of a shipped curriculum; ``arithmetic`` is the default the server falls back to."""
    try:
        return builtin_curricula()[name]
    except KeyError:
        known = ", ".join(builtin_curricula()) or "none"
        raise FileNotFoundError(f"no shipped curriculum named {name!r}; shipped: {known}") from None
