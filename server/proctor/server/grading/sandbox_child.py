"""The process inside a sandbox: ``python -I sandbox_child.py``, started as root (or as the server's user).

It reads its job (JSON) from stdin, isolates itself (mount, network and IPC namespaces; the whole file
system read-only but for a fresh size-limited tmpfs at its working directory), sets its resource limits,
drops to the job's unprivileged uid and only then compiles and runs the program against its tests. Each
test's verdict goes out on the job's results pipe as soon as it is known, prefixed by the job's nonce, so that
a verdict sent before the process was killed still counts and a line the program prints never does.

Standard library only, and nothing from proctor: this file runs under ``-I -S``, with no path but the stdlib's
and the site-packages folders its job names.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import json
import os
import resource
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing costs the child 2 ms to import, each run
    from typing import Any

__all__ = ["main"]

_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (a syscall added after the tables merged)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SETUP_FAILED = 70  # the exit status that says the sandbox could not be set up: the program never ran


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _OutputLimit(BaseException):
    """More output than the job allows. A BaseException, so that the program's ``except Exception`` keeps it."""


class _TestTimeout(BaseException):
    """A test ran past its time limit."""


class _Capped(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` for the program: keeps what it writes, up to a shared budget."""

    def __init__(self, budget: list[int], keep: bool) -> None:
        self.budget = budget
        self.parts: list[str] | None = [] if keep else None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.budget[0] -= len(text)
        if self.budget[0] < 0:
            raise _OutputLimit
        if self.parts is not None:
            self.parts.append(text)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self.parts or ())


def _check(libc: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _isolate(libc: ctypes.CDLL, workdir: str, uid: int, disk_kb: int) -> None:
    _check(libc, libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare")
    _check(libc, libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    options = f"size={disk_kb}k,mode=0700,uid={uid},gid={uid}".encode()
    _check(libc, libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options), "mount tmpfs")
    _expose_imports(libc, workdir)
    every = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    _check(
        libc,
        libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, ctypes.byref(every), ctypes.sizeof(every)),
        "mount_setattr / read-only",
    )
    writable = _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
    _check(
        libc,
        libc.syscall(
            _SYS_MOUNT_SETATTR, _AT_FDCWD, workdir.encode(), 0, ctypes.byref(writable), ctypes.sizeof(writable)
        ),
        "mount_setattr workdir read-write",
    )


def _limit(limits: dict[str, int]) -> None:
    cpu = limits["cpu_s"]
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the limit, SIGKILL a second later if it is caught
        ("RLIMIT_AS", limits["memory_bytes"], limits["memory_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),
        ("RLIMIT_NPROC", limits["processes"], limits["processes"]),
        ("RLIMIT_FSIZE", limits["file_bytes"], limits["file_bytes"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop(libc: ctypes.CDLL, uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # Set after the uid change, which clears it: the sandbox dies with the grader that started it.
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _expose_imports(libc: ctypes.CDLL, workdir: str) -> None:
    """Bind the import path's folders that the run's uid could not reach (an interpreter under /root, as pyenv
    installs it) into the working directory, read-only like everything else, and import from there."""
    moved = {}
    for n, entry in enumerate(list(sys.path)):
        if not entry or not os.path.isdir(entry) or _readable_by_all(entry):
            continue
        target = os.path.join(workdir, ".python", str(n))
        os.makedirs(target)
        _check(libc, libc.mount(entry.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), "bind " + entry)
        sys.path[n] = moved[entry] = target
    # Packages imported already (encodings, whose codecs load on first use) look for their modules there too.
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            for k, folder in enumerate(path):
                for entry, target in moved.items():
                    if folder.startswith(entry + os.sep):
                        path[k] = target + folder[len(entry) :]
    sys.path_importer_cache.clear()
    os.chmod(workdir, 0o700)


# Imported before the uid changes when the interpreter's standard library is not readable by every user and no
# mount namespace can make it so (uid isolation): the program can then still import what solutions commonly use.
_PRELOAD = (
    "array bisect collections copy dataclasses datetime decimal enum fractions functools heapq itertools math "
    "operator random re socket statistics string time typing encodings.idna"
).split()


def _readable_by_all(path: str) -> bool:
    parts = os.path.abspath(path).split(os.sep)
    for n in range(1, len(parts) + 1):
        mode = os.stat(os.sep + os.path.join(*parts[1:n]) if n > 1 else os.sep).st_mode
        if not mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o004)


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def main() -> None:
    job: dict[str, Any] = json.loads(sys.stdin.buffer.read())
    sys.path.extend(job["path"])  # started without `site` (-S): its .pth hooks cost more than the run
    nonce: str = job["nonce"]
    write, dumps, results = os.write, json.dumps, job["results_fd"]

    def report(index: int, verdict: str, message: str = "") -> None:
        write(results, (nonce + dumps([index, verdict, message[:300]]) + "\n").encode())

    libc = ctypes.CDLL(None, use_errno=True)
    workdir, uid = job["workdir"], job["uid"]
    try:
        if job["namespaces"]:
            _isolate(libc, workdir, uid, job["limits"]["disk_kb"])
        _limit(job["limits"])
        if uid is not None and not job["namespaces"] and not _readable_by_all(os.path.dirname(os.__file__)):
            for module in _PRELOAD:
                __import__(module)
        if uid is not None:
            _drop(libc, uid)
        os.chdir(workdir)
    except OSError as exc:
        report(-1, "setup", str(exc))
        os._exit(_SETUP_FAILED)
    report(-1, "isolated")
    os.environ.clear()
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    sys.stdin = io.StringIO("")
    tests: list[Any] = job["tests"]
    try:
        program = compile(job["code"], "<solution>", "exec")
    except (SyntaxError, ValueError) as exc:
        report(-1, "syntax", f"{type(exc).__name__}: {exc}")
        return
    budget = [job["limits"]["output_chars"]]
    test_timeout = job["test_timeout_s"]

    def on_alarm(signum: int, frame: object) -> None:
        raise _TestTimeout

    def run(source: Any, namespace: dict[str, Any], stdin: str) -> tuple[str | None, str, str]:
        """Run ``source`` in ``namespace``: ``(None, "", its output)`` when it ran, else ``(verdict, message, "")``."""
        signal.signal(signal.SIGALRM, on_alarm)
        sys.stdin = io.StringIO(stdin)
        out = sys.stdout = _Capped(budget, keep=True)
        sys.stderr = _Capped(budget, keep=False)
        signal.setitimer(signal.ITIMER_REAL, test_timeout)
        try:
            try:
                exec(source, namespace)
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _TestTimeout:
            return "timeout", "", ""
        except _OutputLimit:
            return "output", "", ""
        except MemoryError:
            return "memory", "", ""
        except AssertionError:
            return "fail", "", ""
        except BaseException as exc:  # the program's own exceptions, SystemExit(1) among them
            return "error", f"{type(exc).__name__}: {exc}", ""
        return None, "", out.getvalue()

    io_tests = all(isinstance(t, dict) for t in tests)
    shared: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    loaded, why, _ = (None, "", "") if io_tests else run(program, shared, "")
    for index, test in enumerate(tests):
        if loaded is not None:  # the program itself failed: so does every test of it
            report(index, loaded, why)
            continue
        if io_tests:
            fresh = {"__name__": "__main__", "__builtins__": builtins}
            verdict, message, printed = run(program, fresh, test["input"])
            if verdict is None:
                verdict = "pass" if _normalised(printed) == _normalised(test["output"]) else "fail"
        else:
            verdict, message, _ = run(compile(test, f"<test {index}>", "exec"), shared, "")
            verdict = verdict or "pass"
        report(index, verdict, message)


if __name__ == "__main__":
    main()
