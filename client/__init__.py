"""The trainer side of proctor: the dataserver client and the TRL integration.

``ProctorClient`` and its errors need only httpx and pydantic. ``RemoteRLDataset`` needs the ``train``
extra (``datasets``); it is imported on first use, so that the client works in a server-only install, and so is
``DockClient`` (the experience store's client, which needs numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proctor.client.errors import (
    Conflict,
    DataserverError,
    NotReadyError,
    RequestRejected,
    ServerError,
    ServerFailure,
    TransportError,
    Unauthorized,
)
from proctor.client.http import ProctorClient
from proctor.client.rewards import remote_reward

if TYPE_CHECKING:
    from proctor.client.dataset import GenerationLayout, RemoteRLDataset
    from proctor.client.dock import DockClient

__all__ = [
    "Conflict",
    "DataserverError",
    "DockClient",
    "GenerationLayout",
    "NotReadyError",
    "ProctorClient",
    "RemoteRLDataset",
    "RequestRejected",
    "ServerError",
    "ServerFailure",
    "TransportError",
    "Unauthorized",
    "remote_reward",
]


def __getattr__(name: str) -> Any:
    if name in ("RemoteRLDataset", "GenerationLayout"):
        from proctor.client import dataset

        return getattr(dataset, name)
    if name == "DockClient":
        from proctor.client.dock import DockClient

        return DockClient
    raise AttributeError(f"module 'proctor.client' has no attribute {name!r}")
