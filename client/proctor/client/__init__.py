"""The trainer side of proctor: the dataserver client and the TRL integration.

``ProctorClient`` and its errors need only httpx and pydantic. ``RemoteRLDataset`` needs the ``train``
extra (``datasets``); it is imported on first use, so that the client works in a server-only install, and so
are ``ExperienceClient`` (the experience store's client), ``remote_reward`` and ``export_rollouts``, which need
numpy (and pyarrow, for a parquet export).
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

if TYPE_CHECKING:
    from proctor.client.dataset import GenerationLayout, RemoteRLDataset
    from proctor.client.experience import ExperienceClient
    from proctor.client.export import export_rollouts
    from proctor.client.rewards import GraderReward, RemoteReward, remote_reward

__all__ = [
    "Conflict",
    "DataserverError",
    "ExperienceClient",
    "GenerationLayout",
    "GraderReward",
    "NotReadyError",
    "ProctorClient",
    "RemoteRLDataset",
    "RemoteReward",
    "RequestRejected",
    "ServerError",
    "ServerFailure",
    "TransportError",
    "Unauthorized",
    "export_rollouts",
    "remote_reward",
]


def __getattr__(name: str) -> Any:
    if name in ("RemoteRLDataset", "GenerationLayout"):
        from proctor.client import dataset

        return getattr(dataset, name)
    if name == "ExperienceClient":
        from proctor.client.experience import ExperienceClient

        return ExperienceClient
    if name in ("GraderReward", "RemoteReward", "remote_reward"):
        from proctor.client import rewards

        return getattr(rewards, name)
    if name == "export_rollouts":
        from proctor.client.export import export_rollouts

        return export_rollouts
    raise AttributeError(f"module 'proctor.client' has no attribute {name!r}")
