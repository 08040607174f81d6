"""Server settings: one pydantic-settings model, every field readable from a ``PROCTOR_`` variable.

Built once by the entry point (the CLI, or a test) and passed to :func:`proctor.server.app.create_app`;
nothing reads the environment at import time.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from proctor.experience.database import is_postgresql
from proctor.server.exceptions import ProctorError
from proctor.server.shipped import builtin_path
from proctor.wire.dataserver import MAX_ITERATION

__all__ = ["Settings", "SettingsError", "default_workers", "load_settings"]


def default_workers() -> int:
    """One grader process per core the server may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class SettingsError(ProctorError, ValueError):
    """Invalid configuration; the message names the environment variable to fix."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PROCTOR_", env_file=".env", env_ignore_empty=True, extra="ignore", frozen=True
    )

    curriculum: Path = Field(
        default_factory=builtin_path,
        description="Curriculum YAML file; default: the shipped arithmetic ladder.",
    )
    run: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="The run's name, which names its state file; default: the curriculum's name and hash.",
    )
    state_dir: Path = Field(default=Path(".proctor/runs"), description="Where each run keeps its state, as <run>.db.")
    database_url: str | None = Field(
        default=None,
        description=(
            "The run's database, in place of <state_dir>/<run>.db: a SQLite file (a path, or sqlite:///path; :memory: "
            "for a throwaway run), or a PostgreSQL database, postgresql://user:password@host:port/database."
        ),
    )
    state_sync: Literal["normal", "full"] = Field(
        default="normal",
        description="SQLite synchronous mode: normal survives crashes, full also power loss.",
    )
    state_wait_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long start-up waits for a PostgreSQL state database that does not answer yet.",
    )
    seed: int | None = Field(default=None, description="Overrides the curriculum's seed.")
    transitions: Path | None = Field(
        default=None,
        description="Another run's GET /curriculum answer: adopt its stage history (see proctor serve --transitions).",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    advertise_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^/\s]+/?$",
        description="Where the other servers of a shared PostgreSQL database reach this one, http://host:port; "
        "default: http://<host>:<port>, with this machine's address in place of a wildcard host.",
    )
    api_key: SecretStr | None = Field(
        default=None, description="When set, every route but /healthz needs `Authorization: Bearer <key>`."
    )
    max_batch_size: int = Field(default=4096, ge=1, description="Largest batch_size /sample accepts.")
    max_iteration_leap: int = Field(
        default=100_000,
        ge=1,
        le=MAX_ITERATION,
        description="How far past the latest sampled iteration a new /sample may reach: a stray request would "
        "otherwise make its iteration the run's latest for good.",
    )
    # The defaults bound what one request costs on the event loop (tens of milliseconds for the worst body of
    # the largest size, `python -m bench event_loop`); ProctorClient splits a larger /grade to fit them.
    max_grade_items: int = Field(default=4096, ge=1, description="Most items one /grade request may carry.")
    max_completion_chars: int = Field(default=200_000, ge=1, description="Longest completion /grade accepts.")
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, description="Largest request body (413).")
    peer_default_source: str | None = Field(
        default=None,
        description="The curriculum source whose graders grade a /score (or OpenRLHF, slime) completion whose label "
        "is not a sample id, against the label as its reference answer; unset: such a label is refused.",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Server processes on the port; more than one needs a PostgreSQL database: one serves it, the "
        "others stand by, grade /grade requests of sampled steps and take over when it ends.",
    )
    grader_workers: int = Field(
        default_factory=default_workers,
        ge=0,
        description="Grader processes; 0 leaves grading to `proctor grade-worker` processes.",
    )
    grader_timeout_s: float = Field(default=10.0, gt=0, description="Time limit to grade one completion.")
    grader_claim_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="How long /grade waits for a grader (a `proctor grade-worker`, with PROCTOR_GRADER_WORKERS=0) "
        "to claim its completions before it answers 503.",
    )
    judge_api_key: SecretStr | None = Field(
        default=None,
        description="Sent to the curriculum's judge graders as `Authorization: Bearer <key>`; never logged, never "
        "shown by GET /graders (a `proctor grade-worker` reads its own PROCTOR_JUDGE_API_KEY).",
    )
    experience_keep_iterations: int = Field(
        default=8,
        ge=1,
        le=1_000_000,
        description="Generation steps the experience store (/experience) keeps, and as many tables of loose "
        "completions.",
    )
    sample_cache: int = Field(default=256, ge=0, description="Recent iterations kept in memory for repeats.")
    sample_cache_bytes: int = Field(
        default=64 * 1024 * 1024, ge=0, description="Most bytes of encoded samples those iterations may hold."
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field(default="text", description="Log lines as text or as JSON objects.")
    shutdown_timeout_s: float = Field(
        default=30.0, gt=0, description="On SIGTERM, how long in-flight requests may take before they are cut."
    )
    # Connection limits, enforced by proctor.server.connection before a request reaches the app.
    max_header_bytes: int = Field(
        default=16384, ge=1024, description="Longest request line plus headers, in bytes (431 past it)."
    )
    max_headers: int = Field(default=100, ge=8, description="Most header fields in one request (431 past it).")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="Time for a request's headers to arrive, from its first byte (408)."
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="Time for a request's body to arrive once its headers are in (408)."
    )
    max_connections: int = Field(
        default=1024, ge=1, description="Open connections (idle ones count) past which requests get a 503."
    )

    def run_name(self, curriculum: str, curriculum_hash: str) -> str:
        """The run's name: ``run``, or the curriculum's name and hash, so that an edited curriculum is a new run."""
        return self.run or f"{curriculum}-{curriculum_hash}"

    def state_path(self, curriculum: str, curriculum_hash: str) -> str:
        """Where the run keeps its state: a SQLite file's path, ``:memory:``, or a ``postgresql://`` URL; from
        ``database_url`` when given, else ``<state_dir>/<run>.db``."""
        if self.database_url is not None:
            return self.database_url
        return str(self.state_dir / f"{self.run_name(curriculum, curriculum_hash)}.db")

    def advertised_url(self) -> str:
        """:attr:`advertise_url`, or this server's address as another machine would reach it."""
        if self.advertise_url is not None:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @field_validator("curriculum")
    @classmethod
    def _exists(cls, path: Path) -> Path:
        if not path.is_file():
            raise ValueError(f"no curriculum file at {path}")
        return path

    @field_validator("database_url")
    @classmethod
    def _database(cls, url: str | None) -> str | None:
        # Kept as a SQLite path, ":memory:" or a postgresql:// URL: what the store opens.
        if url is None or is_postgresql(url):
            return url
        if url.startswith("sqlite:"):
            path = url.removeprefix("sqlite:").removeprefix("//")
            if path.startswith("/"):
                path = path[1:]  # sqlite:///relative.db, sqlite:////absolute.db, as SQLAlchemy reads them
            return path or ":memory:"
        if "://" in url:
            raise ValueError(
                f"{url.split('://', 1)[0]}:// is not a database proctor keeps state in; give a SQLite file (a path, "
                "or sqlite:///path) or a PostgreSQL database (postgresql://user:password@host:port/database)"
            )
        return url


# Settings under a name they had before, and the name they have now.
_RENAMED = {
    "PROCTOR_DOCK_KEEP_ITERATIONS": "PROCTOR_EXPERIENCE_KEEP_ITERATIONS",
    "PROCTOR_STATE": "PROCTOR_DATABASE_URL",
}


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment (and ``.env``) with explicit overrides on top.

    Raises :class:`SettingsError` naming the offending ``PROCTOR_*`` variable, so that a bad value stops
    start-up with a message an operator can act on.
    """
    for old, new in _RENAMED.items():
        if old in os.environ:
            # An unknown PROCTOR_* variable is ignored: a setting under its former name would silently take the
            # default instead of the value the operator set.
            raise SettingsError(f"invalid configuration:\n  {old} is now {new}: set that instead")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            lines.append(f"PROCTOR_{name.upper()} ({name}): {err['msg']}; got {err.get('input')!r}")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(lines)) from None
