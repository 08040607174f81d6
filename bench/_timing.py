"""A trainer callback that times optimizer steps, shared by the GRPO benchmarks."""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

__all__ = ["StepTimes"]


class StepTimes(TrainerCallback):
    """Wall time of every training step, in milliseconds, in ``times``."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append((time.perf_counter() - self._t0) * 1e3)
