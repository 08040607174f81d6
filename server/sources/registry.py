"""Builds sources from their specs; the one place that knows every source kind."""

from __future__ import annotations

from pathlib import Path

from proctor.server.curriculum.spec import ArithmeticSourceSpec, FileSourceSpec, SourceSpec
from proctor.server.sources.arithmetic import ArithmeticSource
from proctor.server.sources.base import Source
from proctor.server.sources.files import FileSource

__all__ = ["SOURCE_KINDS", "build_source"]

SOURCE_KINDS = ("arithmetic", "jsonl", "parquet", "csv")


def build_source(name: str, spec: SourceSpec, *, base_dir: Path, seed: int) -> Source:
    """Instantiate the source a spec describes; file sources read their data here."""
    if isinstance(spec, ArithmeticSourceSpec):
        return ArithmeticSource(name, spec, seed)
    if isinstance(spec, FileSourceSpec):
        return FileSource(name, spec, base_dir)
    raise TypeError(f"no source kind for {type(spec).__name__}")  # pragma: no cover
