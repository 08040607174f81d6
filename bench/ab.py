"""``python -m bench.ab --base REV``: the rollout path's loads (``bench/rollout_path.py``) against this checkout's
server and against ``REV``'s (a commit of this repository, run from a worktree of it), in alternating pairs of
runs on the same machine, each on a fresh server and state.

What a change did, where the machine's noise from run to run (a tenth of the rate, and more from hour to hour) is
as large as the change: alternating the two builds puts each pair in the same moment of the machine, and the
medians over the pairs compare them. ``--state`` picks the loads: ``sqlite`` and ``postgresql`` run ``/sample``
of new iterations and then ``/grade`` of those steps; ``remote`` runs ``/grade`` with two ``proctor
grade-worker`` processes as the grader role (the workers of each run are of its build too).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._baseline import available, checkout
from bench._load import Row
from bench._postgresql import PostgreSQLCluster, cluster
from bench._results import save
from bench.rollout_path import CONCURRENCY, environment, on_server, with_grade_workers, write_rows

__all__ = ["BUILDS", "STATES", "run", "table"]

ROOT = Path(__file__).resolve().parents[1]
BUILDS = ("base", "this")
STATES = ("sqlite", "postgresql", "remote")
PAIRS = 4
SECONDS = 6.0


def run(base: str, *, state: str = "sqlite", pairs: int = PAIRS, seconds: float = SECONDS) -> dict[str, Any]:
    """``pairs`` pairs of runs, ``base``'s server and this checkout's, the first of each pair alternating."""
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")
    results: dict[str, Any] = {
        "env": environment(seconds),
        "base": _commit(base),
        "this": _commit("HEAD") + (" with changes" if _changed() else ""),
        "state": state,
        "runs": [],
    }
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="proctor-ab-")))
        base_env, _ = stack.enter_context(checkout(base))
        pg = stack.enter_context(cluster()) if state == "postgresql" else None
        curriculum, answer_of = write_rows(folder)
        for pair in range(pairs):
            for build in BUILDS if pair % 2 == 0 else BUILDS[::-1]:
                env = base_env if build == "base" else {}
                name = f"{build}-{pair}"
                if state == "remote":
                    rows = {"grade": with_grade_workers(folder, curriculum, answer_of, seconds, env=env, name=name)}
                else:
                    url = _database(pg, folder, name)
                    rows = on_server(folder, curriculum, answer_of, seconds, url, env=env, name=name)
                results["runs"].append({"build": build, "pair": pair, **{k: asdict(v) for k, v in rows.items()}})
                print(_line(results["runs"][-1]), flush=True)
    return results


def _database(pg: PostgreSQLCluster | None, folder: Path, name: str) -> str:
    return pg.new_database() if pg is not None else str(folder / f"{name}.db")


def _commit(ref: str) -> str:
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True)
    return found.stdout.strip() or ref


def _changed() -> bool:
    status = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return bool(status.stdout.strip())


def _line(entry: dict[str, Any]) -> str:
    parts = [f"pair {entry['pair']} {entry['build']:4}"]
    for key in ("sample", "grade"):
        if key in entry:
            r = Row(**entry[key])
            parts.append(f"/{key} {r.per_second:.1f} req/s p99 {r.p99_ms:.1f} ms CPU {r.cpu_ms or 0:.2f} ms")
    return " | ".join(parts)


def _medians(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    rows = [Row(**r[key]) for r in runs]
    return (
        statistics.median(r.per_second for r in rows),
        statistics.median(r.p99_ms for r in rows),
        statistics.median(r.cpu_ms or 0.0 for r in rows),
    )


def table(results: dict[str, Any]) -> str:
    """Each build's medians over its runs, per load, and this checkout's ÷ the base's."""
    keys = [k for k in ("sample", "grade") if k in results["runs"][0]]
    lines = [
        "| load | build | runs | req/s (median) | req/s (range) | p99 ms (median) | server CPU ms/req (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in keys:
        name = Row(**results["runs"][0][key]).name
        medians: dict[str, tuple[float, float, float]] = {}
        for build in BUILDS:
            runs = [r for r in results["runs"] if r["build"] == build]
            rates = [Row(**r[key]).per_second for r in runs]
            medians[build] = rate, p99, cpu = _medians(runs, key)
            label = f"{build} ({results[build]})"
            lines.append(
                f"| {name} | {label} | {len(runs)} | {rate:.1f} | {min(rates):.1f}–{max(rates):.1f} | {p99:.1f} | "
                f"{cpu:.2f} |"
            )
        base, this = medians["base"], medians["this"]
        ratio = this[0] / base[0] if base[0] else float("nan")
        lines.append(
            f"| {name} | this ÷ base (rate), − base (p99, CPU) | | {ratio:.3f}× | | {this[1] - base[1]:+.1f} | "
            f"{this[2] - base[2]:+.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (e.g. HEAD~1, a hash)")
    parser.add_argument("--state", choices=STATES, default="sqlite", help="which loads (default sqlite)")
    parser.add_argument("--pairs", type=int, default=PAIRS, help=f"pairs of runs (default {PAIRS})")
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"per load and run (default {SECONDS:g})")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.seconds <= 0:
        parser.error("--pairs must be at least 1 and --seconds positive")
    if not available(args.base):
        parser.error(f"--base {args.base}: no such commit in this clone (a shallow clone may lack it: git fetch)")
    results = run(args.base, state=args.state, pairs=args.pairs, seconds=args.seconds)
    env = results["env"]
    print(
        f"\nthis checkout ({results['this']}) against {results['base']}, {args.state}, {args.pairs} pairs, "
        f"{CONCURRENCY} connections, {env['cpus']} CPUs, Python {env['python']}, {env['seconds']:g} s each"
    )
    print(table(results))
    save("ab", results)


if __name__ == "__main__":
    main()
