"""The experience store: every rollout of recent generation steps, column by column, shared by the roles that
produce and consume it (``ExperienceStore``), in this process or behind the dataserver (``proctor.client.experience``).
"""

from __future__ import annotations

from proctor.experience.consumers import Collected, Consumer, Consumption, Dispatch
from proctor.experience.errors import (
    CellConflictError,
    CellsMissingError,
    ExperienceError,
    ExperienceInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
)
from proctor.experience.limits import ExperienceLimits
from proctor.experience.loop import consume
from proctor.experience.store import ExperienceStore
from proctor.experience.tables import RowKey, TableInfo
from proctor.experience.values import Value

__all__ = [
    "CellConflictError",
    "CellsMissingError",
    "Collected",
    "Consumer",
    "Consumption",
    "Dispatch",
    "ExperienceError",
    "ExperienceInputError",
    "ExperienceLimits",
    "ExperienceStore",
    "LeaseError",
    "RowKey",
    "ShapeConflictError",
    "TableInfo",
    "UnknownConsumerError",
    "UnknownIterationError",
    "Value",
    "consume",
]
