"""Fixtures of the experience store's tests.

``experience`` is the face the behaviour tests run against, once per face: the in-process ``ExperienceStore`` (in a
SQLite file, and in a PostgreSQL database), and ``ExperienceClient`` talking to a real server (uvicorn on a loopback
port, the store in its SQLite state file).
The tests use only the methods both faces share (and ``proctor.experience.consume``). ``experience_path`` is for the
tests that reopen the file themselves (in-process only, in ``test_durability.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from proctor.client.experience import ExperienceClient
from proctor.experience import ExperienceStore
from proctor.experience.loop import ExperienceLike


@pytest.fixture
def experience_path(tmp_path: Path) -> Path:
    return tmp_path / "experience.db"


@pytest.fixture(params=["in-process", "in-process-postgresql", "http"])
def experience(
    request: pytest.FixtureRequest, experience_path: Path, live_server: Callable[..., AbstractContextManager[str]]
) -> Iterator[ExperienceLike]:
    if request.param.startswith("in-process"):
        where = request.getfixturevalue("postgresql_url") if request.param.endswith("postgresql") else experience_path
        store = ExperienceStore(where)
        try:
            yield store
        finally:
            store.close()
        return
    with live_server(state=str(experience_path)) as url, ExperienceClient(url) as client:
        yield client
