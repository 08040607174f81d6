"""``python -m bench.profile``: where a server process's interpreter goes during one of the rollout path's loads.

A real ``proctor serve`` (or ``--workers N`` of them on PostgreSQL, or one whose grader role is two ``proctor
grade-worker`` processes) takes ``bench/rollout_path.py``'s loads, ``/sample`` of new iterations then ``/grade`` of
64 completions on 8 connections, while py-spy records the process during the load asked for. py-spy runs with
``--gil``: a sample is taken only while a thread holds the interpreter's lock, the resource a server process runs
out of (its event loop and its store's thread share it). A sample is of the thread that holds it.

The profile is printed per process: how much of the time the interpreter was held, that time per request at the
load's rate, and each function's *inclusive* share of the samples (a sample counts for every function on its
stack, once however deep it recurs). Frames on every stack of the event loop, or of the other threads (the
interpreter's and the executor's entry points), say nothing and are left out, as is a function that passes 97%
of its samples on to one callee (a middleware, a wrapper): the callee stands for it. ``--under NAME`` breaks one
function down: the shares, among the samples whose stack passes through it, of the functions it called.
``--keep DIR`` keeps py-spy's raw profiles (one line a stack: ``frame;frame;… count``) for slicing otherwise.

It is not part of ``make bench``: it prints no figure a goal is measured against, only where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench._load import Row
from bench._postgresql import cluster
from bench.replicas import until_both_answer
from bench.rollout_path import KEEP_TABLES, ROOT, grade_workers, measure, write_rows
from proctor.cli.launcher import ServerProcess

__all__ = ["LOADS", "STATES", "Profile", "main", "read_profile"]

LOADS = ("sample", "grade")
STATES = ("sqlite", "postgresql", "remote")
SECONDS = 12.0
RATE_HZ = 250
TOP = 30
EVENT_LOOP = "event loop"
THREADS = "other threads"
_PASSED_ON = 0.97
# py-spy attaches within the first second of the load, and stops a second before its end.
_MARGIN_S = 1.0


@dataclass(frozen=True)
class Profile:
    """py-spy's raw profile of one process: each stack (its functions, outermost first, as ``name (file)``),
    how many samples it took, and whether it ran on the event loop (the main thread) or another thread."""

    stacks: tuple[tuple[tuple[str, ...], int, str], ...]

    @property
    def samples(self) -> int:
        return sum(n for _, n, _ in self.stacks)

    def by_thread(self) -> dict[str, int]:
        """The samples of the event loop and of the other threads."""
        out = dict.fromkeys((EVENT_LOOP, THREADS), 0)
        for _, n, group in self.stacks:
            out[group] += n
        return out

    def shares(self, under: str | None = None, top: int = TOP) -> tuple[int, list[tuple[str, int]]]:
        """The samples considered (all, or those whose stack passes through a function named ``under``, which
        matches a function's name or its ``name (file)``), and each function's inclusive count among them (below
        ``under``, when given), the largest ``top`` first."""
        counts: Counter[str] = Counter()
        callees: dict[str, Counter[str]] = {}
        considered = 0
        plumbing = self._plumbing() if under is None else {}
        for frames, n, group in self.stacks:
            if under is not None:
                at = next((i for i, f in enumerate(frames) if under in (f, f.split(" (")[0])), None)
                if at is None:
                    continue
                frames = frames[at + 1 :]
            considered += n
            for f in set(frames) - plumbing.get(group, set()):
                counts[f] += n
            for caller, callee in itertools.pairwise(frames):
                if caller != callee:  # a recursion passes nothing on
                    callees.setdefault(caller, Counter())[callee] += n
        # A function that hands nearly all its samples to one callee (a middleware, a wrapper) is shown as it.
        shown = [(f, n) for f, n in counts.items() if f not in callees or max(callees[f].values()) < _PASSED_ON * n]
        return considered, sorted(shown, key=lambda fn: -fn[1])[:top]

    def _plumbing(self) -> dict[str, set[str]]:
        """Per thread group, the functions on every one of its stacks."""
        every: dict[str, set[str]] = {}
        for frames, _, group in self.stacks:
            every[group] = set(frames) if group not in every else every[group] & set(frames)
        return every


def read_profile(lines: Iterable[str]) -> Profile:
    """A profile from py-spy's raw output (``py-spy record -f raw``)."""
    stacks = []
    for line in lines:
        text, _, count = line.rstrip("\n").rpartition(" ")
        if not text or not count.isdigit():
            continue
        frames = tuple(_function(f) for f in text.split(";"))
        group = THREADS if frames and frames[0].startswith("Thread._bootstrap ") else EVENT_LOOP
        stacks.append((frames, int(count), group))
    return Profile(tuple(stacks))


def _function(frame: str) -> str:
    """``name (path/to/file.py:123)`` as ``name (file.py)``: a function, whichever of its lines ran."""
    name, _, where = frame.partition(" (")
    if not where:
        return name
    return f"{name} ({where.rstrip(')').rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


@dataclass(frozen=True)
class Recorded:
    """One process's profile, and what it was."""

    label: str
    profile: Profile


def py_spy() -> str:
    """py-spy's executable: beside this interpreter (the dev extra installs it), else on the PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("python -m bench.profile: py-spy is not installed; pip install py-spy (the dev extra has it)")
    return found


class _Recorder:
    """py-spy on each of ``targets`` during the load ``load``, from a second into it to a second before its end."""

    def __init__(
        self, spy: str, targets: Sequence[tuple[str, int]], load: str, seconds: float, rate: int, folder: Path
    ):
        self._spy = spy
        self._targets, self._load, self._rate, self._folder = targets, load, rate, folder
        self.duration = max(1, int(seconds - 2 * _MARGIN_S))
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []

    def on_phase(self, phase: str) -> None:
        if phase == self._load:
            self._thread = threading.Thread(target=self._record, name="py-spy")
            self._thread.start()

    def _record(self) -> None:
        time.sleep(_MARGIN_S)
        spy = [self._spy, "record", "--gil", "-r", str(self._rate), "-d", str(self.duration), "-f", "raw"]
        runs = [
            (
                label,
                subprocess.Popen(
                    [*spy, "-p", str(pid), "-o", str(self._folder / f"{pid}.txt")],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for label, pid in self._targets
        ]
        for label, spying in runs:
            _, err = spying.communicate()
            if spying.returncode != 0:
                said = err.strip().splitlines()[-1] if err.strip() else f"exit code {spying.returncode}"
                self._failures.append(f"py-spy on {label}: {said}")

    def profiles(self) -> list[Recorded]:
        if self._thread is None:
            raise RuntimeError(f"the {self._load} load never began")
        self._thread.join()
        if self._failures:
            raise SystemExit("python -m bench.profile: " + "; ".join(self._failures))
        out = []
        for label, pid in self._targets:
            with open(self._folder / f"{pid}.txt") as f:
                out.append(Recorded(label, read_profile(f)))
        return out


def _children(pid: int) -> list[int]:
    """The server processes a ``proctor serve --workers N`` started (Linux's ``/proc``)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    servers = []
    for kid in kids:
        with contextlib.suppress(OSError), open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                servers.append(kid)
    return servers


def run(
    spy: str, load: str, state: str, workers: int, seconds: float, rate: int, folder: Path
) -> tuple[Row, list[Recorded], float]:
    """The load's row, each profiled process's profile (recorded by the py-spy at ``spy``), and how long py-spy
    recorded."""
    curriculum, answer_of = write_rows(folder)
    with contextlib.ExitStack() as stack:
        database = str(folder / "state.db")
        if state == "postgresql":
            database = stack.enter_context(cluster()).new_database()
        args = [str(curriculum), "--database-url", database, "--log-level", "warning"]
        if workers > 1:
            args += ["--workers", str(workers)]
        if state == "remote":
            args += ["--grader-workers", "0"]
        server = stack.enter_context(ServerProcess(args, log=folder / "server.log", cwd=ROOT, env=KEEP_TABLES))
        targets: list[tuple[str, int]] = [("server", server.pid)]
        if workers > 1:
            until_both_answer(server.url)
            targets = [(f"server process {n}", pid) for n, pid in enumerate(_children(server.pid))]
        if state == "remote":
            remote = stack.enter_context(grade_workers(server.url, KEEP_TABLES))
            targets += [(f"grade-worker {n}", w.pid) for n, w in enumerate(remote)]
        recorder = _Recorder(spy, targets, load, seconds, rate, folder)
        rows = asyncio.run(measure(server.port, seconds, answer_of, on_phase=recorder.on_phase))
        return rows[load], recorder.profiles(), float(recorder.duration)


def render(row: Row, recorded: Sequence[Recorded], duration: float, rate: int, under: str | None, top: int) -> str:
    lines = []
    for r in recorded:
        p = r.profile
        held = p.samples / rate / duration
        per_request = held * 1000 / row.per_second if row.per_second else 0.0
        threads = ", ".join(f"{k} {100 * n / max(p.samples, 1):.0f}%" for k, n in p.by_thread().items())
        lines.append(
            f"{r.label}: the interpreter held {100 * held:.0f}% of {duration:g} s, {per_request:.2f} ms a request at "
            f"{row.per_second:.0f} req/s ({threads} of the samples)"
        )
        considered, counts = p.shares(under, top)
        if under is not None:
            lines.append(f"  below {under}: {considered} of {p.samples} samples")
        lines += [f"  {100 * n / max(considered, 1):5.1f}%  {name}" for name, n in counts]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", choices=LOADS, default="grade", help="the load to profile (default: grade)")
    parser.add_argument("--state", choices=STATES, default="sqlite", help="as bench.ab's (default: sqlite)")
    parser.add_argument("--workers", type=int, default=1, help="proctor serve --workers N (PostgreSQL only)")
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"each load's length (default {SECONDS:g})")
    parser.add_argument("--rate", type=int, default=RATE_HZ, help=f"py-spy's samples a second (default {RATE_HZ})")
    parser.add_argument("--top", type=int, default=TOP, help=f"functions listed per process (default {TOP})")
    parser.add_argument("--under", help="break this function down (its name, or name (file.py))")
    parser.add_argument("--keep", type=Path, help="keep py-spy's raw profiles in this folder")
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 8:
        parser.error(f"--workers must be 1 to 8, got {args.workers}")
    if args.workers > 1 and args.state != "postgresql":
        parser.error("--workers N > 1 runs server processes of one PostgreSQL database: add --state postgresql")
    if args.seconds < 3 or not 1 <= args.rate <= 1000 or args.top < 1:
        parser.error("--seconds must be at least 3, --rate 1 to 1000, --top at least 1")
    spy = py_spy()  # before any server starts
    with _folder(args.keep) as folder:
        row, recorded, duration = run(spy, args.load, args.state, args.workers, args.seconds, args.rate, folder)
    workers = f", --workers {args.workers}" if args.workers > 1 else ""
    print(
        f"{row.name}, {args.state}{workers}, 8 connections, {args.seconds:g} s; py-spy --gil at {args.rate} Hz for "
        f"{duration:g} s of it\n"
    )
    print(render(row, recorded, duration, args.rate, args.under, args.top))


@contextlib.contextmanager
def _folder(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="proctor-profile-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    main()
