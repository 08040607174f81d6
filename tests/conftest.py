"""Shared fixtures: a small curriculum on disk, settings for it, the app behind httpx, and a real server process."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI

from bench._postgresql import PostgreSQLCluster, cluster
from proctor.cli.launcher import ServerProcess
from proctor.server.app import create_app
from proctor.server.connection import uvicorn_options
from proctor.server.settings import Settings


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """``proctor serve`` gives the root logger one handler on the stderr of the moment, which pytest closes when the
    test ends: a later test's server would log into the closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def system_command(name: str) -> str:
    """The path of a Debian package's command that a test drives (curl, docker-compose, chromium); a test without
    it fails, saying how to get it (`make test` installs them)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (as root), or run `apt-get install {name}`")
    return path


GRADERS_PY = """
import os
import time


def slow(sample, *, seconds=30.0):
    time.sleep(seconds)
    return 1.0


def boom(sample):
    raise RuntimeError("boom: this grader fails on purpose")


def crash(sample):
    os._exit(7)


def half(sample):
    return 0.5
"""

QA_ROWS = [
    {"q": "Capital of France?", "a": "Paris", "topic": "geo"},
    {"q": "Colour of the sky?", "a": "blue", "topic": "nature"},
    {"q": "2 + 2?", "a": "4", "topic": "math"},
    {"q": "Opposite of hot?", "a": "cold", "topic": "words"},
    {"q": "Largest planet?", "a": "Jupiter", "topic": "space"},
    {"q": "Frozen water?", "a": "ice", "topic": "nature"},
]

# Small on purpose: a gated first stage, a mixed second stage with replay, and sources that exist only to
# be graded directly (a slow, a failing and a crashing grader).
TINY = {
    "name": "tiny",
    "seed": 5,
    "system_prompt": "Answer briefly.",
    "sources": {
        "add": {"kind": "arithmetic", "ops": ["+"], "digits": [1, 1], "graders": ["numeric"]},
        "qa": {
            "path": "qa.jsonl",
            "prompt_field": "q",
            "answer_field": "a",
            "graders": [{"name": "exact_match"}, {"name": "half", "weight": 0}],
            "on_error": -1.0,
        },
        "slowpoke": {"kind": "arithmetic", "graders": [{"name": "slow", "params": {"seconds": 30}}], "on_error": -0.5},
        "faulty": {"kind": "arithmetic", "graders": ["numeric", "boom"], "on_error": -1.0},
        "crashy": {"kind": "arithmetic", "graders": ["crash"]},
    },
    "graders": {
        "slow": {"python": "./graders.py:slow"},
        "boom": {"python": "./graders.py:boom"},
        "crash": {"python": "./graders.py:crash"},
        "half": {"python": "./graders.py:half"},
    },
    "stages": [
        {
            "name": "warm",
            "until_step": 10,
            "mix": [{"source": "add"}],
            "advance": {"threshold": 0.9, "window": 4, "min_steps": 2},
        },
        {
            "name": "main",
            "until_step": 20,
            "mix": [{"source": "add", "weight": 0.25}, {"source": "qa", "weight": 0.75}],
        },
        {"name": "final", "until_step": 30, "mix": [{"source": "qa"}], "replay": 0.5},
    ],
}


def write_curriculum(folder: Path, doc: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graders.py").write_text(GRADERS_PY)
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA_ROWS))
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc or TINY, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings read PROCTOR_* variables; a developer's shell must not change what the tests see.
    for name in list(os.environ):
        if name.startswith("PROCTOR_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 and tokenizer built offline, once per test session."""
    from proctor.client.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def curriculum_file(tmp_path: Path) -> Path:
    return write_curriculum(tmp_path / "curriculum")


@pytest.fixture
def tiny_doc() -> dict[str, Any]:
    """A copy of the tiny curriculum to edit; write it with ``write_tiny``."""
    return copy.deepcopy(TINY)


@pytest.fixture
def write_tiny(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    """Write an edited tiny curriculum (with its data and graders) and return its path."""
    return lambda doc: write_curriculum(tmp_path / "edited-curriculum", doc)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--database",
        choices=("sqlite", "postgresql"),
        default="sqlite",
        help="where the servers the tests start keep their state: SQLite files (default), or PostgreSQL databases "
        "(each state file a test names, and each in-memory state, becomes a fresh database of its own)",
    )


# A test that runs a real server, as a process or as uvicorn in a thread, is end-to-end: make test-fast leaves it
# out. So are those in tests/e2e/, and the experience store's HTTP face, whose every case starts a server.
_REAL_SERVERS = {"live_server", "server_process"}
_E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            _REAL_SERVERS & set(getattr(item, "fixturenames", ()))
            or params.get("experience") == "http"
            or _E2E in Path(item.path).parents
        ):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def database(request: pytest.FixtureRequest) -> str:
    """Where the servers this run of the tests starts keep their state: ``sqlite`` or ``postgresql``."""
    kind: str = request.config.getoption("--database")
    return kind


@pytest.fixture
def state_target(request: pytest.FixtureRequest, database: str) -> Callable[[str], str]:
    """``state_target(path)``: where a server or store the test starts keeps the state it would keep at ``path`` (a
    file, or ``:memory:``): that path, or under ``--database postgresql`` a PostgreSQL database, the same for the
    same path within a test."""
    if database == "sqlite":
        return lambda path: path
    pg: PostgreSQLCluster = request.getfixturevalue("postgresql_cluster")
    databases: dict[str, str] = {}

    def target(path: str) -> str:
        if path.startswith("postgresql://"):
            return path
        if path == ":memory:":
            return pg.new_database()
        if path not in databases:
            databases[path] = pg.new_database()
        return databases[path]

    return target


@pytest.fixture
def make_settings(curriculum_file: Path, state_target: Callable[[str], str]) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "curriculum": curriculum_file,
            "database_url": ":memory:",
            "grader_workers": 1,
            "grader_timeout_s": 2.0,
        }
        values.update(overrides)
        if values["database_url"] is not None:
            values["database_url"] = state_target(str(values["database_url"]))
        return Settings(**values)

    return make


@asynccontextmanager
async def serve_asgi(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app behind httpx's ASGI transport, with its lifespan running (the transport does not run it)."""
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                scope["state"] = dict(state or {})
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://proctor.test") as client:
            yield client


@pytest.fixture
def open_client(make_settings: Callable[..., Settings]) -> Callable[..., Any]:
    """``async with open_client(**settings_overrides) as client:`` for tests that need their own settings."""

    def open_(**overrides: Any) -> Any:
        return serve_asgi(create_app(make_settings(**overrides)))

    return open_


@pytest.fixture
async def client(make_settings: Callable[..., Settings]) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_asgi(create_app(make_settings())) as c:
        yield c


@contextmanager
def serve_in_thread(app: FastAPI, options: dict[str, Any] | None = None) -> Iterator[str]:
    """The app on a real uvicorn server, in a thread of this process, on a free loopback port.

    ``options`` are more ``uvicorn.Config`` arguments, e.g. ``uvicorn_options(settings)`` to configure the
    connections as ``proctor serve`` does.
    """
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, **(options or {}))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-thread server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def live_server(make_settings: Callable[..., Settings]) -> Callable[..., AbstractContextManager[str]]:
    """``with live_server(**settings_overrides) as url:`` a real server in a thread, for sync clients."""

    def start(**overrides: Any) -> AbstractContextManager[str]:
        settings = make_settings(**overrides)
        return serve_in_thread(create_app(settings), uvicorn_options(settings))

    return start


@pytest.fixture
def server_process(tmp_path: Path, state_target: Callable[[str], str]) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``proctor serve ARGS`` processes; all are stopped when the test ends. A ``--database-url`` in ARGS is
    mapped by ``state_target`` (a PostgreSQL database under ``--database postgresql``)."""
    started: list[ServerProcess] = []

    def start(args: list[str], **kwargs: Any) -> ServerProcess:
        args = [state_target(a) if n and args[n - 1] == "--database-url" else a for n, a in enumerate(args)]
        proc = ServerProcess(args, log=tmp_path / f"server-{len(started)}.log", **kwargs).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def postgresql_cluster() -> Iterator[PostgreSQLCluster]:
    """A PostgreSQL server for the session (see ``bench/_postgresql.py``)."""
    with cluster() as pg:
        yield pg
