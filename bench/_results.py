"""Where every benchmark leaves its raw numbers: ``bench/results/<name>.json`` (git-ignored)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["save"]

RESULTS = Path(__file__).resolve().parent / "results"


def save(name: str, payload: Any) -> Path:
    path = RESULTS / f"{name}.json"
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
