"""The ``proctor`` command: parses ``serve | validate | preview | grade-worker | export | regrade | train | demo`` and
dispatches each.

The dataserver's subcommands (``proctor.cli.dataserver``), ``grade-worker`` and ``regrade`` need the ``server`` extra;
``export`` needs pyarrow for parquet; ``train`` and ``demo`` need the ``train`` extra (torch, TRL). Each is
imported only when asked for.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from proctor.cli.dataserver import preview, serve, validate
from proctor.errors import ProctorError
from proctor.experience import ExperienceLimits

__all__ = ["build_parser", "main"]


def _demo(args: argparse.Namespace) -> int:
    try:
        from proctor.cli.demo import demo
    except ImportError as exc:
        return _needs_train_extra("demo", exc)
    return demo(steps=args.steps)


# The packages of the `train` extra: a command that cannot import one of them says how to install it.
_TRAIN_EXTRA = frozenset({"torch", "transformers", "trl", "datasets", "accelerate"})


def _needs_train_extra(command: str, exc: ImportError) -> int:
    """One line saying how to install the `train` extra; any other import error is a bug, and is raised."""
    if not isinstance(exc, ModuleNotFoundError) or (exc.name or "").split(".")[0] not in _TRAIN_EXTRA:
        raise exc
    print(
        f"proctor {command}: error: needs the train extra (torch, transformers, TRL), and {exc.name} is not "
        "installed: run `make train` (or `make demo`) from a checkout, or `pip install 'proctor[train]'`",
        file=sys.stderr,
    )
    return 2


def _regrade(args: argparse.Namespace) -> int:
    from proctor.cli.regrade import regrade

    return regrade(args)


def _grade_worker(args: argparse.Namespace) -> int:
    from proctor.cli.grade_worker import grade_worker

    return grade_worker(args)


def _export(args: argparse.Namespace) -> int:
    from proctor.cli.export import export

    return export(args)


def _whole(high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside 1 to {high}")
        return value

    return parse


_count = _whole(4096)  # processes or actors
_rows = _whole(ExperienceLimits().max_rows_per_call)  # rows one dispatch claims: the server's bound
_tables = _whole(ExperienceLimits().max_tables_per_call)  # tables one dispatch takes rows of: the server's bound


def build_parser() -> argparse.ArgumentParser:
    """The `proctor` command line, every subcommand but `train` (which parses its own options)."""
    parser = argparse.ArgumentParser(prog="proctor", description="Curriculum dataserver for RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    # Options are never abbreviated: a prefix of one option name could stand for another (--state, --state-dir).
    serve_p = sub.add_parser("serve", help="serve a curriculum over HTTP", allow_abbrev=False)
    serve_p.add_argument(
        "curriculum",
        nargs="?",
        help="a curriculum YAML file, or a shipped one's name (default: arithmetic, env PROCTOR_CURRICULUM)",
    )
    serve_p.add_argument("--host", help="bind address (default 127.0.0.1, env PROCTOR_HOST)")
    serve_p.add_argument("--port", type=int, help="port (default 8000, env PROCTOR_PORT)")
    serve_p.add_argument(
        "--run",
        dest="run_name",
        metavar="NAME",
        help="the run's name, which names its state file (default: the curriculum's name and hash, env PROCTOR_RUN)",
    )
    serve_p.add_argument(
        "--fresh", action="store_true", help="start the run over: remove its state file first (default: resume it)"
    )
    serve_p.add_argument(
        "--state-dir",
        type=Path,
        help="where each run keeps its state, as RUN.db (default .proctor/runs, env PROCTOR_STATE_DIR)",
    )
    serve_p.add_argument(
        "--database-url",
        metavar="PATH|URL",
        help="the run's database in place of STATE_DIR/RUN.db: a SQLite file (a path, or sqlite:///PATH; :memory: for "
        "a throwaway run), or a PostgreSQL database, postgresql://USER:PASSWORD@HOST:PORT/DB "
        "(env PROCTOR_DATABASE_URL)",
    )
    serve_p.add_argument(
        "--seed", type=int, help="override the curriculum's seed (default: the file's, env PROCTOR_SEED)"
    )
    serve_p.add_argument(
        "--transitions",
        type=Path,
        help="another run's GET /curriculum answer: serve its iterations exactly as it did (env PROCTOR_TRANSITIONS)",
    )
    serve_p.add_argument(
        "--workers",
        type=int,
        help="server processes on the port (default 1, env PROCTOR_WORKERS); more than one needs a PostgreSQL "
        "database (--database-url): one serves it, the others stand by and grade",
    )
    serve_p.add_argument(
        "--grader-workers",
        type=int,
        help="grader processes; 0 leaves grading to proctor grade-workers (default: one per core, divided among "
        "--workers processes; env PROCTOR_GRADER_WORKERS)",
    )
    serve_p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log lines shown (default info, env PROCTOR_LOG_LEVEL)",
    )
    serve_p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="log lines as text or JSON (default text, env PROCTOR_LOG_FORMAT)",
    )
    serve_p.set_defaults(run=serve)

    validate_p = sub.add_parser("validate", help="check a curriculum file and its data")
    validate_p.add_argument("curriculum", help="a curriculum YAML file, or a shipped one's name")
    validate_p.set_defaults(run=validate)

    preview_p = sub.add_parser("preview", help="show the stage of each step and a sample prompt of each stage")
    preview_p.add_argument("curriculum", help="a curriculum YAML file, or a shipped one's name")
    preview_p.add_argument("--steps", default=":", help="START:STOP, STOP excluded (default: the whole curriculum)")
    preview_p.add_argument(
        "--batch-size", type=int, default=8, help="prompts per step, for the sample prompts and --simulate (default 8)"
    )
    preview_p.add_argument(
        "--simulate",
        action="store_true",
        help="train a simulated learner on the curriculum's own stages, samplers and gates, and show each stage",
    )
    preview_p.add_argument(
        "--lag", type=int, help="with --simulate: steps the statistics trail the learner by (default 1, a real client)"
    )
    preview_p.add_argument("--group-size", type=int, help="with --simulate: completions per prompt (default 8)")
    preview_p.set_defaults(run=preview)

    worker_p = sub.add_parser("grade-worker", help="grade a dataserver's completions on this machine")
    worker_p.add_argument("--server", required=True, help="the dataserver's URL, e.g. http://10.0.0.5:8000")
    worker_p.add_argument(
        "--workers", type=_count, help="grader processes (default: one per core; with --ray-actors, per actor: 1)"
    )
    worker_p.add_argument("--api-key", help="the server's API key (default: env PROCTOR_API_KEY)")
    worker_p.add_argument(
        "--rows-per-dispatch", type=_rows, default=256, help="rows claimed at a time (default 256, at most 65536)"
    )
    worker_p.add_argument(
        "--tables-per-dispatch",
        type=_tables,
        default=8,
        help="tables a claim may take those rows from, a lease each: a step's, or a /grade's (default 8, at most 64)",
    )
    worker_p.add_argument(
        "--connect-timeout-s", type=float, default=60.0, help="how long to wait for the server at start (default 60)"
    )
    worker_p.add_argument(
        "--lease-s", type=float, default=30.0, help="lease on claimed rows, renewed while grading (default 30)"
    )
    worker_p.add_argument(
        "--exit-when-idle-s", type=float, help="stop after this long without a row to grade (default: never)"
    )
    worker_p.add_argument(
        "--ray-actors",
        type=_count,
        metavar="N",
        help="run N grade-workers as Ray actors instead of one here (needs the ray extra: pip install 'proctor[ray]')",
    )
    worker_p.add_argument(
        "--ray-address",
        help="the Ray cluster the actors join, e.g. auto (default: env RAY_ADDRESS, else a local Ray instance)",
    )
    worker_p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="the least severe log lines shown (default info)",
    )
    worker_p.set_defaults(run=_grade_worker)

    export_p = sub.add_parser("export", help="write a dataserver's kept rollouts to parquet or JSON lines")
    export_p.add_argument("out", type=Path, help="the file to write")
    export_p.add_argument(
        "--server", default="http://127.0.0.1:8000", help="the dataserver's URL (default http://127.0.0.1:8000)"
    )
    export_p.add_argument("--iterations", default=":", help="START:STOP, STOP excluded (default: every table kept)")
    export_p.add_argument(
        "--stage", action="append", metavar="NAME", help="only this curriculum stage's rows; repeatable (default: all)"
    )
    export_p.add_argument(
        "--source", action="append", metavar="NAME", help="only this source's rows; repeatable (default: all)"
    )
    export_p.add_argument(
        "--format", choices=["parquet", "jsonl"], help="(default: parquet for OUT ending .parquet, else jsonl)"
    )
    export_p.add_argument("--api-key", help="the server's API key (default: env PROCTOR_API_KEY)")
    export_p.set_defaults(run=_export)

    regrade_p = sub.add_parser(
        "regrade", help="grade a dataserver's kept completions again, the scores beside the old ones"
    )
    regrade_p.add_argument(
        "--server", default="http://127.0.0.1:8000", help="the dataserver's URL (default http://127.0.0.1:8000)"
    )
    regrade_p.add_argument("--iterations", default=":", help="START:STOP, STOP excluded (default: every table kept)")
    regrade_p.add_argument("--stage", metavar="NAME", help="only the iterations this curriculum stage served")
    regrade_p.add_argument(
        "--grader", metavar="KEY", help="only this grader, its score the reward (default: every grader of a source)"
    )
    regrade_p.add_argument("--workers", type=_count, help="grader processes (default: one per core)")
    regrade_p.add_argument(
        "--rows-per-dispatch", type=_rows, default=256, help="rows claimed at a time (default 256, at most 65536)"
    )
    regrade_p.add_argument("--api-key", help="the server's API key (default: env PROCTOR_API_KEY)")
    regrade_p.set_defaults(run=_regrade)

    # The trainer side needs the `train` extra (torch, TRL); it is imported only when asked for, and
    # parses its own options (main() hands them over before this parser sees them).
    sub.add_parser("train", help="GRPO with TRL against a running dataserver (see `proctor train --help`)")
    demo_p = sub.add_parser("demo", help="serve the arithmetic ladder and train a tiny model across a stage boundary")
    demo_p.add_argument(
        "--steps", type=int, default=64, help="optimizer steps, one curriculum iteration each (default 64)"
    )
    demo_p.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        try:
            from proctor.client.training.command import main as train_main
        except ImportError as exc:
            return _needs_train_extra("train", exc)
        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    # Every configuration or data error the server raises at start-up (a bad curriculum, setting, state
    # file, history, SQLite) is a ProctorError with a message that says what to do: no traceback.
    except ProctorError as exc:
        print(f"proctor {args.command}: {exc}", file=sys.stderr)
        return 2
    return code
