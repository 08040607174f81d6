"""The experience store: every rollout of recent generation steps, column by column, shared by the roles that
produce and consume it (``TransferDock``), in this process or behind the dataserver (``proctor.client.dock``).
"""

from __future__ import annotations

from proctor.dock.dock import (
    Collected,
    Consumer,
    Consumption,
    Dispatch,
    DockLimits,
    RowKey,
    TableInfo,
    TransferDock,
)
from proctor.dock.errors import (
    CellConflictError,
    CellsMissingError,
    DockError,
    DockInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
)
from proctor.dock.loop import consume
from proctor.dock.values import Value

__all__ = [
    "CellConflictError",
    "CellsMissingError",
    "Collected",
    "Consumer",
    "Consumption",
    "Dispatch",
    "DockError",
    "DockInputError",
    "DockLimits",
    "LeaseError",
    "RowKey",
    "ShapeConflictError",
    "TableInfo",
    "TransferDock",
    "UnknownConsumerError",
    "UnknownIterationError",
    "Value",
    "consume",
]
