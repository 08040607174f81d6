"""``proctor serve | validate | preview``: the command line of the dataserver."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from proctor.curricula import builtin_curricula, builtin_path
from proctor.server.curriculum.engine import StageSchedule
from proctor.server.curriculum.loader import load_curriculum
from proctor.server.curriculum.mixing import Mixer, stage_runs
from proctor.server.curriculum.spec import CurriculumError
from proctor.server.history import HistoryError, adopt_history, read_history
from proctor.server.logs import configure_logging
from proctor.server.settings import SettingsError, load_settings
from proctor.server.store import StateMismatchError, Store

__all__ = ["main"]


def _curriculum_path(value: str | None) -> Path | None:
    """A path, or the name of a shipped curriculum (``arithmetic``, ``word_problems``)."""
    if value is None:
        return None
    path = Path(value)
    if not path.exists() and value in builtin_curricula():
        return builtin_path(value)
    return path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proctor.server.app import create_app
    from proctor.server.connection import uvicorn_options

    settings = load_settings(
        curriculum=_curriculum_path(args.curriculum),
        host=args.host,
        port=args.port,
        state=args.state,
        seed=args.seed,
        transitions=args.transitions,
        grader_workers=args.grader_workers,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    configure_logging(settings.log_level, settings.log_format)
    curriculum = load_curriculum(settings.curriculum, seed=settings.seed)
    history = None if settings.transitions is None else read_history(settings.transitions, curriculum)
    if settings.state != ":memory:":
        # Refuse a state file of another curriculum here, with a plain message, rather than as a traceback
        # from inside the server's start-up.
        store = Store(settings.state, synchronous=settings.state_sync)
        try:
            store.bind(curriculum=curriculum.name, curriculum_hash=curriculum.hash, seed=curriculum.seed)
            if history is not None:
                adopt_history(store, history, source=str(settings.transitions))
        finally:
            store.close()
    app = create_app(settings, curriculum_obj=curriculum)
    # On SIGTERM uvicorn stops accepting, lets in-flight requests finish for up to shutdown_timeout_s, then
    # runs the lifespan's shutdown, which stops the graders and closes the state file.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        **uvicorn_options(settings),
    )
    return 0


def _validate(args: argparse.Namespace) -> int:
    curriculum = load_curriculum(_curriculum_path(args.curriculum) or builtin_path())
    sources = ", ".join(
        f"{n} ({s.kind}, {s.size if s.size is not None else '∞'})" for n, s in curriculum.sources.items()
    )
    print(f"ok: {curriculum.path}")
    print(f"  curriculum {curriculum.name!r}, hash {curriculum.hash}, seed {curriculum.seed}")
    print(f"  {len(curriculum.stages)} stages over {curriculum.total_iterations} iterations")
    print(f"  sources: {sources}")
    return 0


def _parse_steps(text: str, total: int) -> range:
    start_text, sep, stop_text = text.partition(":")
    try:
        start = int(start_text) if start_text else 0
        stop = int(stop_text) if sep and stop_text else (total if sep else start + 1)
    except ValueError:
        raise SystemExit(f"--steps: expected START:STOP (e.g. 0:300), got {text!r}") from None
    if start < 0 or stop <= start:
        raise SystemExit(f"--steps: need 0 ≤ START < STOP, got {text!r}")
    return range(start, stop)


def _preview(args: argparse.Namespace) -> int:
    curriculum = load_curriculum(_curriculum_path(args.curriculum) or builtin_path())
    steps = _parse_steps(args.steps, curriculum.total_iterations)
    print(
        f"{curriculum.name} (hash {curriculum.hash}, seed {curriculum.seed}): "
        f"{len(curriculum.stages)} stages, {curriculum.total_iterations} iterations"
    )
    print(f"stage per step for steps {steps.start}:{steps.stop}, assuming no gate fires (each stage at its longest):")
    # With no transitions recorded, a schedule's stage is the step-keyed one.
    step_keyed = StageSchedule(curriculum.stages).stage_of
    runs = stage_runs(step_keyed, steps.stop, steps.start)
    for first, stop, stage in runs:
        last = stop - 1
        st = curriculum.stages[stage]
        mix = ", ".join(f"{s} {w:.0%}" for s, w in st.mix)
        extra = f", replay {st.replay:.0%}" if st.replay else ""
        print(f"  {first:>6}–{last:<6} {st.name}  [{mix}{extra}]")
        if st.advance is not None:
            a = st.advance
            print(
                f"  {'':>14} may end early: mean reward ≥ {a.threshold:g} over {a.window} graded completions, "
                f"after ≥ {a.min_steps} steps"
            )
    if steps.stop > curriculum.total_iterations:
        print(f"  (steps from {curriculum.total_iterations} on are past total_iterations: the last stage continues)")
    print("a sample prompt of each stage:")
    mixer = Mixer(curriculum)
    seen: set[int] = set()
    for first, _, stage in runs:
        if stage in seen:
            continue
        seen.add(stage)
        source, key = mixer.draw(first, args.batch_size, step_keyed)[0]
        record = curriculum.sources[source].record(key)
        print(f"  {curriculum.stages[stage].name} [{source}]: {record.prompt!r} → {record.answer!r}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from proctor.client.train import demo

    return demo(steps=args.steps)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proctor", description="Curriculum dataserver for RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a curriculum over HTTP")
    serve.add_argument("curriculum", nargs="?", help="curriculum YAML (default: the shipped arithmetic ladder)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1, env PROCTOR_HOST)")
    serve.add_argument("--port", type=int, help="port (default 8000, env PROCTOR_PORT)")
    serve.add_argument("--state", help="SQLite state file, or :memory: (default proctor-state.db, env PROCTOR_STATE)")
    serve.add_argument("--seed", type=int, help="override the curriculum's seed (env PROCTOR_SEED)")
    serve.add_argument(
        "--transitions",
        type=Path,
        help="another run's GET /curriculum answer: serve its iterations exactly as it did (env PROCTOR_TRANSITIONS)",
    )
    serve.add_argument("--grader-workers", type=int, help="grader processes (default: one per core)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["text", "json"], help="log lines as text (default) or JSON")
    serve.set_defaults(run=_serve)

    validate = sub.add_parser("validate", help="check a curriculum file and its data")
    validate.add_argument("curriculum")
    validate.set_defaults(run=_validate)

    preview = sub.add_parser("preview", help="show the stage of each step and a sample prompt of each stage")
    preview.add_argument("curriculum")
    preview.add_argument("--steps", default=":", help="START:STOP (default: the whole curriculum)")
    preview.add_argument("--batch-size", type=int, default=8, help="batch size used to draw the sample prompts")
    preview.set_defaults(run=_preview)

    # The trainer side needs the `train` extra (torch, TRL); it is imported only when asked for, and
    # parses its own options (main() hands them over before this parser sees them).
    sub.add_parser("train", help="GRPO with TRL against a running dataserver (see `proctor train --help`)")
    demo = sub.add_parser("demo", help="serve the arithmetic ladder and train a tiny model across a stage boundary")
    demo.add_argument("--steps", type=int, default=64)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from proctor.client.train import main as train_main

        return train_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except (CurriculumError, SettingsError, StateMismatchError, HistoryError) as exc:
        print(f"proctor {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
