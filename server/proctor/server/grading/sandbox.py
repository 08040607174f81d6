"""Runs untrusted Python against tests, one fresh process per run: :func:`run_program`.

The process (:mod:`proctor.server.grading.sandbox_child`) isolates itself before the program is compiled:

- **Isolation** (``namespaces``, when the server runs as root where namespaces are allowed): new mount,
  network, IPC and UTS namespaces. The network namespace has no interface up, so no address answers; every
  mount is read-only but a fresh tmpfs (``disk_kb``) at the run's working directory, gone when it ends.
- **An unprivileged uid of its own**, taken from a range no account uses and held by one run at a time (a lock
  file per uid), so the process limit counts this run's processes alone, and the program can neither signal
  nor read the server's processes (``/proc/PID/environ`` among them). Whatever that uid still runs afterwards
  is killed.
- **Limits**: CPU seconds, address space, open files, processes, file size, and, read here, the output on its
  standard streams; a wall-clock limit here too. Its environment is empty but for ``HOME``, ``TMPDIR``,
  ``PATH`` and ``LANG``.

Where namespaces are not allowed (a container without ``CAP_SYS_ADMIN``), ``uid`` isolation still runs the
program under its own uid with the limits, but it can reach the network and write where any user may
(``/tmp``). Not running as root, only the limits apply (``rlimits``). A run asks for the least isolation it
accepts and is refused (:class:`SandboxUnavailable`) before the program runs when the machine gives less.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.server.exceptions import ProctorError

__all__ = [
    "Isolation",
    "RunKind",
    "SandboxLimits",
    "SandboxRun",
    "SandboxUnavailable",
    "Test",
    "available_isolation",
    "run_program",
]

_CHILD = Path(__file__).with_name("sandbox_child.py")
# Uids no account uses (Debian's dynamic and system ranges end far below), one per concurrent run.
_UID_BASE, _UID_SLOTS = 1_900_000, 1024
_SETUP_FAILED = 70
_READ = 65536
_RESULTS_CAP = 1 << 20  # verdict lines: a few hundred bytes per test

# A test: Python statements run after the program (``assert solve(2) == 4``), or a stdin/stdout pair.
Test = str | dict[str, str]


class Isolation(enum.IntEnum):
    """How far a run is kept from the machine, from least to most."""

    RLIMITS = 0
    UID = 1
    NAMESPACES = 2


class RunKind(enum.Enum):
    """Why a run, or a test of it, did not pass."""

    TIMEOUT = "timeout"
    MEMORY = "memory"
    CRASH = "crash"
    SYNTAX = "syntax"
    OUTPUT = "output"


class SandboxUnavailable(ProctorError, RuntimeError):
    """The machine cannot give a run the isolation it asks for; the program did not run."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    cpu_s: int = 4
    wall_s: float = 6.0
    memory_mb: int = 512
    processes: int = 16
    open_files: int = 64
    file_mb: int = 16
    disk_mb: int = 32
    output_kb: int = 256
    test_timeout_s: float = 4.0


@dataclass(frozen=True, slots=True)
class SandboxRun:
    """One run: each test's verdict (``pass``, ``fail``, ``error`` or a :class:`RunKind` value) with its message,
    and why the run itself ended early, if it did."""

    verdicts: tuple[str, ...]
    messages: tuple[str, ...]
    failure: RunKind | None
    message: str
    isolation: Isolation

    @property
    def passed(self) -> int:
        return sum(v == "pass" for v in self.verdicts)


def available_isolation() -> Isolation:
    """The most this process can give a run: namespaces need root (and a kernel and container that allow them)."""
    if os.geteuid() != 0:
        return Isolation.RLIMITS
    return _namespaces_allowed()


@functools.cache
def _namespaces_allowed() -> Isolation:
    """Found out once per process, by a run: whether the kernel and the container let it make namespaces."""
    try:
        _run("pass", ["pass"], SandboxLimits(), Isolation.NAMESPACES, sys.executable)
    except SandboxUnavailable:
        return Isolation.UID
    return Isolation.NAMESPACES


def run_program(
    code: str,
    tests: Sequence[Test],
    limits: SandboxLimits,
    *,
    require: Isolation = Isolation.NAMESPACES,
    python: str = sys.executable,
) -> SandboxRun:
    """Run ``code`` against ``tests`` in a fresh sandboxed process; raises :class:`SandboxUnavailable` when the
    machine cannot isolate it as far as ``require``."""
    level = available_isolation()
    if level < require:
        raise SandboxUnavailable(
            f"the sandbox needs {require.name.lower()} isolation, this machine gives {level.name.lower()}: "
            + (
                "grade as root (the server, or a proctor grade-worker)"
                if level == Isolation.RLIMITS
                else "allow namespaces (CAP_SYS_ADMIN, and seccomp and AppArmor profiles that allow unshare and mount)"
            )
            + " as docker/compose.yaml's sandbox profile does in Docker, or lower the grader's `isolation` param "
            "(the docs say what each level keeps out)"
        )
    return _run(code, tests, limits, level, python)


def _run(code: str, tests: Sequence[Test], limits: SandboxLimits, level: Isolation, python: str) -> SandboxRun:
    with _uid_slot(level) as uid, _workdir(uid) as workdir:
        nonce = secrets.token_hex(16)
        job = {
            "nonce": nonce,
            "code": code,
            "tests": list(tests),
            "workdir": str(workdir),
            "uid": uid,
            "namespaces": level == Isolation.NAMESPACES,
            "test_timeout_s": limits.test_timeout_s,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_mb << 20,
                "open_files": limits.open_files,
                "processes": limits.processes,
                "file_bytes": limits.file_mb << 20,
                "disk_kb": limits.disk_mb << 10,
                "output_chars": limits.output_kb << 10,
            },
        }
        outcome = _execute(python, job, nonce, limits, uid)
    lines, status, killed = outcome
    if status == _SETUP_FAILED and lines and lines[0][1] == "setup":
        raise SandboxUnavailable(f"the sandbox could not isolate a run: {lines[0][2]}")
    return _verdicts(len(tests), lines, status, killed, level)


def _execute(
    python: str, spec: dict[str, Any], nonce: str, limits: SandboxLimits, uid: int | None
) -> tuple[list[list[Any]], int, str]:
    """Start the child, feed it the job, read its verdicts; returns them, its exit status and why it was killed."""
    results_r, results_w = os.pipe()
    # The server's own interpreter starts without `site`, whose .pth hooks (an editable install's finder) would cost
    # a run more than the run itself; its site-packages folders go on the path as they are. Another interpreter
    # starts as it would.
    own = python == sys.executable
    job = json.dumps({**spec, "results_fd": results_w, "path": _site_packages() if own else []}).encode()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    try:
        process = subprocess.Popen(
            [python, "-I", *(["-S"] if own else []), "-B", str(_CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(results_w,),
            env=env,
            cwd="/",
            start_new_session=True,
        )
    finally:
        os.close(results_w)
    # Readable when the process exits: its children may hold its pipes open, and the run ends with it.
    exited = os.pidfd_open(process.pid)
    killed = ""
    results = bytearray()
    output_left = limits.output_kb << 10
    try:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        with selectors.DefaultSelector() as sel:
            os.set_blocking(process.stdin.fileno(), False)
            sel.register(process.stdin, selectors.EVENT_WRITE)
            sel.register(process.stdout, selectors.EVENT_READ)
            sel.register(process.stderr, selectors.EVENT_READ)
            sel.register(results_r, selectors.EVENT_READ)
            sel.register(exited, selectors.EVENT_READ)
            view = memoryview(job)
            deadline = time.monotonic() + limits.wall_s
            exited_now = False
            while not (exited_now or killed):
                left = deadline - time.monotonic()
                if left <= 0:
                    killed = RunKind.TIMEOUT.value
                    break
                for key, _ in sel.select(left):
                    stream = key.fileobj
                    if stream == exited:
                        exited_now = True
                    elif stream is process.stdin:
                        try:
                            view = view[os.write(process.stdin.fileno(), view[:_READ]) :]
                        except BrokenPipeError:
                            view = view[:0]
                        if not view:
                            sel.unregister(process.stdin)
                            process.stdin.close()
                    else:
                        fd = stream if isinstance(stream, int) else stream.fileno()
                        chunk = os.read(fd, _READ)
                        if not chunk:
                            sel.unregister(stream)
                        elif fd == results_r:
                            results += chunk
                            if len(results) > _RESULTS_CAP + len(job):  # the program flooding the pipe
                                killed = RunKind.OUTPUT.value
                        else:
                            output_left -= len(chunk)
                            if output_left < 0:
                                killed = RunKind.OUTPUT.value
            if exited_now and not killed:
                # What it wrote is in the pipe now, whoever else (a child of it) still holds the pipe open.
                results += _drain(results_r)
    finally:
        _kill(process, uid)
        os.close(results_r)
        os.close(exited)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
    lines = []
    prefix = nonce.encode()
    for line in bytes(results).splitlines():
        if line.startswith(prefix):
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line[len(prefix) :]))
    return lines, process.returncode, killed


@functools.cache
def _site_packages() -> list[str]:
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _drain(fd: int) -> bytes:
    """What is in a pipe now, without waiting for its writers to close it."""
    os.set_blocking(fd, False)
    data = bytearray()
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _READ):
            data += chunk
    return bytes(data)


def _verdicts(n: int, lines: list[list[Any]], status: int, killed: str, level: Isolation) -> SandboxRun:
    verdicts: list[str | None] = [None] * n
    messages = [""] * n
    failure: RunKind | None = None
    message = ""
    for index, verdict, text in lines:
        if index == -1 and verdict == RunKind.SYNTAX.value:
            failure, message = RunKind.SYNTAX, text
        elif 0 <= index < n and verdicts[index] is None:
            verdicts[index], messages[index] = verdict, text
    if failure is None:
        if killed:
            failure = RunKind(killed)
            message = (
                "the run passed its wall-clock limit"
                if failure is RunKind.TIMEOUT
                else "the run wrote more than its output limit"
            )
        elif status < 0:
            sig = -status
            if sig in (signal.SIGXCPU, signal.SIGKILL):
                failure, message = RunKind.TIMEOUT, "the run used up its CPU time"
            elif sig == signal.SIGXFSZ:
                failure, message = RunKind.OUTPUT, "a file passed the file-size limit"
            else:
                failure, message = RunKind.CRASH, f"the process died of {signal.Signals(sig).name}"
        elif None in verdicts:
            failure, message = RunKind.CRASH, f"the process exited (status {status}) before its tests ran"
    elif failure is RunKind.SYNTAX:
        verdicts = [RunKind.SYNTAX.value] * n
    rest = failure.value if failure is not None else RunKind.CRASH.value
    return SandboxRun(
        tuple(v if v is not None else rest for v in verdicts),
        tuple(messages),
        failure,
        message,
        level,
    )


def _kill(process: subprocess.Popen[bytes], uid: int | None) -> None:
    """Kill the run and everything it started, wherever it moved to (a new session or process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    if uid is not None:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    # The uid is this run's alone (its slot's lock), so every process it has is this run's.
    for _ in range(100):
        found = False
        for pid in _pids_of(uid):
            found = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not found:
            return
        time.sleep(0.01)


def _pids_of(uid: int) -> Iterator[int]:
    """The live processes of ``uid``: a zombie is dead already, waiting for whoever adopted it to reap it."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        state = f.read().rpartition(b")")[2].split()[0]
                    if state not in (b"Z", b"X"):
                        yield int(entry.name)


@contextlib.contextmanager
def _uid_slot(level: Isolation) -> Iterator[int | None]:
    """An unused uid, held (by a lock file) for the run; None where the process cannot change uid."""
    if level < Isolation.UID:
        yield None
        return
    folder = Path(tempfile.gettempdir()) / "proctor-sandbox-uids"
    folder.mkdir(mode=0o700, exist_ok=True)
    start = secrets.randbelow(_UID_SLOTS)
    for k in range(_UID_SLOTS):
        uid = _UID_BASE + (start + k) % _UID_SLOTS
        fd = os.open(folder / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            _kill_uid(uid)  # what a run killed with its grader may have left
            yield uid
        finally:
            os.close(fd)
        return
    raise SandboxUnavailable(f"all {_UID_SLOTS} sandbox uids are in use")


@contextlib.contextmanager
def _workdir(uid: int | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="proctor-sandbox-"))
    try:
        if uid is not None:
            os.chown(path, uid, uid)  # under namespaces the run's tmpfs covers it; without, the run writes here
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
