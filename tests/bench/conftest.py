"""Fixtures shared by the benchmarks' tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def saved_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], dict[str, Any]]:
    """``saved_results(module)``: what the benchmark ``module`` saves, by name, kept here rather than written over the
    real results of a full run in bench/results/."""

    def capture(module: ModuleType) -> dict[str, Any]:
        saved: dict[str, Any] = {}

        def save(name: str, payload: Any) -> Path:
            saved[name] = json.loads(json.dumps(payload))
            return tmp_path / f"{name}.json"

        monkeypatch.setattr(module, "save", save)
        return saved

    return capture
