"""What the sampling and grading services share, built once by the composition root."""

from __future__ import annotations

from dataclasses import dataclass

from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.progress import CurriculumProgress
from proctor.server.metrics import Metrics
from proctor.server.settings import Settings
from proctor.server.storage import AsyncStore

__all__ = ["ServingContext"]


@dataclass(frozen=True, slots=True)
class ServingContext:
    """The curriculum and its live progress, the settings, the metrics and the state file."""

    curriculum: Curriculum
    settings: Settings
    metrics: Metrics
    storage: AsyncStore
    progress: CurriculumProgress
