"""Run ``proctor serve`` as a child process and wait until it answers: for the demo, the benchmarks and the
end-to-end tests, which all need a real server on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ServerProcess:
    """``proctor serve ARGS --port <free port>`` in a child process, its output in ``log``; ``module`` and
    ``subcommand`` run another server that takes ``--port`` and answers ``/healthz``.

    ``env`` is added to this process's environment (a ``PYTHONPATH`` there runs another checkout).

    ``start()`` returns once ``/healthz`` answers; ``stop()`` sends SIGTERM (then SIGKILL if it lingers);
    ``kill()`` is ``kill -9``.
    """

    def __init__(
        self,
        args: list[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
        module: str = "proctor.cli",
        subcommand: str | None = "serve",
    ) -> None:
        self.port = port or free_port()
        self.module = module  # what runs `serve`: another one for an older checkout (`proctor.server.cli`)
        self.subcommand = subcommand  # None for a module that serves with no subcommand (a benchmark's baseline)
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The server's process id, once started."""
        if self.proc is None:
            raise RuntimeError("the server was not started")
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def start(self, timeout: float = 60.0) -> ServerProcess:
        command = [] if self.subcommand is None else [self.subcommand]
        cmd = [sys.executable, "-m", self.module, *command, *self.args, "--port", str(self.port)]
        # A file, not a pipe: a pipe nobody reads fills up and blocks the server on its next log line.
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not answer /healthz within {timeout}s:\n{self.output()}")

    def kill(self) -> None:
        """``kill -9``: no shutdown handler runs."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> str:
        """SIGTERM, then SIGKILL if it lingers; returns everything the server printed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.output()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
