"""Builds sources from their specs; the one place that knows every source kind."""

from __future__ import annotations

from pathlib import Path

from proctor.server.sources.arithmetic import ArithmeticSource
from proctor.server.sources.base import Source
from proctor.server.sources.files import FileSource
from proctor.server.sources.reasoning_core import ReasoningCoreSource
from proctor.server.sources.reasoning_gym import ReasoningGymSource
from proctor.server.spec import (
    ArithmeticSourceSpec,
    FileSourceSpec,
    ReasoningCoreSourceSpec,
    ReasoningGymSourceSpec,
    SourceSpec,
)

__all__ = ["SOURCE_KINDS", "build_source"]

SOURCE_KINDS = ("arithmetic", "jsonl", "parquet", "csv", "reasoning_gym", "reasoning_core")


def build_source(name: str, spec: SourceSpec, *, base_dir: Path, seed: int) -> Source:
    """Instantiate the source a spec describes; file sources read their data here, reasoning-gym and reasoning-core
    are imported here."""
    source: Source
    if isinstance(spec, ArithmeticSourceSpec):
        source = ArithmeticSource(name, spec, seed)
    elif isinstance(spec, FileSourceSpec):
        source = FileSource(name, spec, base_dir)
    elif isinstance(spec, ReasoningGymSourceSpec):
        source = ReasoningGymSource(name, spec, seed)
    elif isinstance(spec, ReasoningCoreSourceSpec):
        source = ReasoningCoreSource(name, spec, seed)
    else:  # pragma: no cover
        raise TypeError(f"no source kind for {type(spec).__name__}")
    source.declared_difficulty = spec.difficulty
    return source
