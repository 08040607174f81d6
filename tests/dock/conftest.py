"""Fixtures of the experience store's tests.

``dock`` is the face the behaviour tests run against, once per face: the in-process ``TransferDock``, and
``DockClient`` talking to a real server (uvicorn on a loopback port, the store in its SQLite state file).
The tests use only the methods both faces share (and ``proctor.dock.consume``). ``dock_path`` is for the
tests that reopen the file themselves (in-process only, in ``test_durability.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from proctor.client.dock import DockClient
from proctor.dock import TransferDock
from proctor.dock.loop import Dock


@pytest.fixture
def dock_path(tmp_path: Path) -> Path:
    return tmp_path / "dock.db"


@pytest.fixture(params=["in-process", "http"])
def dock(
    request: pytest.FixtureRequest, dock_path: Path, live_server: Callable[..., AbstractContextManager[str]]
) -> Iterator[Dock]:
    if request.param == "in-process":
        store = TransferDock(dock_path)
        try:
            yield store
        finally:
            store.close()
        return
    with live_server(state=str(dock_path)) as url, DockClient(url) as client:
        yield client
