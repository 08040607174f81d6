"""Fixtures of the experience store's tests.

``experience`` is the face the behaviour tests run against, once per face: the in-process ``ExperienceStore``, and
``ExperienceClient`` talking to a real server (uvicorn on a loopback port, the store in its state). Both keep their
tables where ``--database`` says: a SQLite file, or a PostgreSQL database.
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


@pytest.fixture(params=["in-process", "http"])
def experience(
    request: pytest.FixtureRequest,
    experience_path: Path,
    live_server: Callable[..., AbstractContextManager[str]],
    state_target: Callable[[str], str],
) -> Iterator[ExperienceLike]:
    if request.param == "in-process":
        store = ExperienceStore(state_target(str(experience_path)))
        try:
            yield store
        finally:
            store.close()
        return
    # No grader processes: these tests drive the store itself, and nothing here grades.
    with live_server(database_url=str(experience_path), grader_workers=0) as url, ExperienceClient(url) as client:
        yield client
