"""A throwaway PostgreSQL server from the installed binaries (Debian's ``postgresql`` package): a cluster in a
temporary folder on a free loopback port, with a fresh database per caller. The tests' fixtures use it (one
cluster a session, a database a test), and so do the benchmarks that measure the PostgreSQL backend."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proctor.cli.launcher import free_port

__all__ = ["PostgreSQLCluster", "cluster"]


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed: `make test` installs it (as root), or run "
            "`apt-get install postgresql`"
        )
    return found[-1]


class PostgreSQLCluster:
    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def ctl(self, *args: str) -> None:
        """``pg_ctl`` on this cluster (``stop``, ``start``): a test that takes the database away and back."""
        _run([_bin("pg_ctl"), "-D", str(self.folder / "data"), "-w", "-l", str(self.folder / "log"), *args])


def _run(cmd: list[str]) -> None:
    # initdb and postgres refuse to run as root: as root, they run as the postgres user.
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


@contextmanager
def cluster() -> Iterator[PostgreSQLCluster]:
    folder = Path(tempfile.mkdtemp(prefix="proctor-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    port = free_port()
    _run([_bin("initdb"), "-D", str(folder / "data"), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
    # In the cluster's own configuration, so that a test that stops and starts it finds it where it was.
    settings = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(port),
        "unix_socket_directories": f"'{folder}'",
        "fsync": "off",
    }
    with open(folder / "data" / "postgresql.auto.conf", "a") as conf:
        conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
    pg = PostgreSQLCluster(folder, port)
    pg.ctl("start")
    try:
        yield pg
    finally:
        try:
            pg.ctl("-m", "immediate", "stop")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
