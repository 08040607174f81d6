"""Fixtures shared by the curriculum tests: writing a curriculum (and its data files) into ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

# write_curriculum(doc, files=None, name="curriculum.yaml") -> path of the written YAML file
WriteCurriculum = Callable[..., Path]


@pytest.fixture
def write_curriculum(tmp_path: Path) -> WriteCurriculum:
    """A function that writes ``doc`` (a dict, dumped as YAML, or raw YAML text) plus ``files`` (relative path →
    text or bytes) under ``tmp_path`` and returns the curriculum's path. Call it again to overwrite."""

    def write(
        doc: Mapping[str, Any] | str,
        files: Mapping[str, str | bytes] | None = None,
        name: str = "curriculum.yaml",
    ) -> Path:
        for rel, content in (files or {}).items():
            target = tmp_path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = doc if isinstance(doc, str) else yaml.safe_dump(dict(doc), sort_keys=False, allow_unicode=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write
