"""``proctor serve | validate | preview``: the dataserver's subcommands (``proctor.cli.main`` parses them)."""

from __future__ import annotations

import argparse
import logging
import socket
import time
from pathlib import Path
from typing import Literal

from proctor.cli import server_processes
from proctor.errors import ProctorError
from proctor.experience.database import is_postgresql
from proctor.server.curriculum.engine import StageSchedule
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.mixing import Mixer, stage_runs
from proctor.server.logs import configure_logging
from proctor.server.services.history import adopt_history, read_history
from proctor.server.settings import load_settings
from proctor.server.shipped import builtin_curricula, builtin_path
from proctor.server.store import Standby, StateInUseError, StateUnreachableError, Store, redacted

__all__ = ["curriculum_path", "preview", "serve", "validate"]


def curriculum_path(value: str | None) -> Path | None:
    """A path, or the name of a shipped curriculum (``arithmetic``, ``word_problems``)."""
    if value is None:
        return None
    path = Path(value)
    if not path.exists() and value in builtin_curricula():
        return builtin_path(value)
    return path


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proctor.server.app import create_app
    from proctor.server.connection import uvicorn_options

    settings = load_settings(
        curriculum=curriculum_path(args.curriculum),
        host=args.host,
        port=args.port,
        run=args.run_name,
        state_dir=args.state_dir,
        database_url=args.database_url,
        seed=args.seed,
        transitions=args.transitions,
        workers=args.workers,
        grader_workers=args.grader_workers,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    configure_logging(settings.log_level, settings.log_format)
    curriculum = load_curriculum(settings.curriculum, seed=settings.seed)
    history = None if settings.transitions is None else read_history(settings.transitions, curriculum)
    state = settings.state_path(curriculum.name, curriculum.hash)
    if settings.workers > 1 and not is_postgresql(state):
        raise ProctorError(
            f"--workers {settings.workers} (PROCTOR_WORKERS) runs server processes of one PostgreSQL database, and "
            f"this run's state is the SQLite file {state}, which one process serves: give a PostgreSQL database "
            "(--database-url postgresql://…), or leave --workers at 1"
        )
    if args.fresh:
        _remove_state(state, settings.host, settings.port)
    if state != ":memory:":
        # Refuse a state file of another curriculum here, with a plain message, rather than as a traceback
        # from inside the server's start-up.
        try:
            store = _open_store(state, settings.state_sync, settings.state_wait_s)
        except StateInUseError:
            if not is_postgresql(state):
                raise
            # Another server serves the database: this one stands by for it (proctor.server.handle), once its
            # curriculum is known to be the database's.
            _check_standby(state, curriculum)
        else:
            try:
                store.bind(curriculum=curriculum.name, curriculum_hash=curriculum.hash, seed=curriculum.seed)
                if history is not None:
                    adopt_history(store, history, source=str(settings.transitions))
            finally:
                store.close()
        # Adopted into the file already: the server's start-up need not read and adopt it again.
        settings = settings.model_copy(update={"transitions": None})
    if settings.workers > 1:
        return server_processes.supervise(settings)
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


def _open_store(state: str, synchronous: Literal["normal", "full"], wait_s: float) -> Store:
    """The run's store; a PostgreSQL database that does not answer yet (starting beside this server, say) is
    waited for, up to ``wait_s``, then refused with a message that names it."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            return Store(state, synchronous=synchronous)
        except StateUnreachableError as exc:
            if time.monotonic() >= deadline:
                raise
            if not waiting:
                logging.getLogger("proctor").warning("%s: waiting up to %g s (PROCTOR_STATE_WAIT_S)", exc, wait_s)
                waiting = True
            time.sleep(0.5)


def _check_standby(state: str, curriculum: Curriculum) -> None:
    standby = Standby(state, curriculum=curriculum.name, curriculum_hash=curriculum.hash, seed=curriculum.seed)
    try:
        standby.poll()
    finally:
        standby.close()


def _remove_state(path: str, host: str, port: int) -> None:
    """``--fresh``: remove the run's state file (with its WAL), refusing while a server holds it or the port is
    taken (a server still running there may be this run's): it would go on writing into the removed file."""
    if is_postgresql(path):
        raise ProctorError(
            f"--fresh removes a state file, and the state is the PostgreSQL database {redacted(path)}: to start the "
            "run over, give it a new, empty database (drop and create it, or name another in --database-url)"
        )
    files = [Path(path + suffix) for suffix in ("", "-wal", "-shm")]
    if path == ":memory:" or not any(f.exists() for f in files):
        return
    try:
        Store.check_free(path)  # a server on another port, say
    except StateInUseError as exc:
        raise ProctorError(f"--fresh: {exc}") from None
    if port:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                raise ProctorError(
                    f"--fresh: {host}:{port} is in use, perhaps by this run's own server; stop it, then start "
                    "again with --fresh"
                ) from None
    for f in files:
        f.unlink(missing_ok=True)
    logging.getLogger("proctor").info("--fresh: removed the run's state file %s", path)


def validate(args: argparse.Namespace) -> int:
    curriculum = load_curriculum(curriculum_path(args.curriculum) or builtin_path())
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


def _simulation_flags(args: argparse.Namespace, steps: range) -> tuple[int, int]:
    """``--lag`` and ``--group-size``, checked; they mean something only with ``--simulate``."""
    if not args.simulate:
        given = [flag for flag, value in (("--lag", args.lag), ("--group-size", args.group_size)) if value is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise SystemExit(f"{' and '.join(given)} {verb} only to the simulated learner: add --simulate")
        return 0, 0
    lag = 1 if args.lag is None else args.lag
    group_size = 8 if args.group_size is None else args.group_size
    if lag < 0:
        raise SystemExit(f"--lag: the statistics lag behind by 0 iterations or more, got {lag}")
    if group_size < 2:
        raise SystemExit(f"--group-size: GRPO compares 2 completions per prompt or more, got {group_size}")
    if steps.start != 0:
        raise SystemExit(
            f"--steps: --simulate trains from step 0; give :STOP or 0:STOP, got {steps.start}:{steps.stop}"
        )
    return lag, group_size


def preview(args: argparse.Namespace) -> int:
    curriculum = load_curriculum(curriculum_path(args.curriculum) or builtin_path())
    steps = _parse_steps(args.steps, curriculum.total_iterations)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size: need 1 prompt per step or more, got {args.batch_size}")
    lag, group_size = _simulation_flags(args, steps)
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
    if args.simulate:
        _simulate(curriculum, steps.stop, args.batch_size, group_size, lag)
    return 0


def _simulate(curriculum: Curriculum, steps: int, batch_size: int, group_size: int, lag: int) -> None:
    """Train the simulated learner (:mod:`proctor.server.curriculum.simulation`) on the curriculum, and print
    what each stage did with it."""
    from proctor.server.curriculum.simulation import LearnerModel, population_from_curriculum, simulate

    population = population_from_curriculum(curriculum, curriculum.seed)
    print(
        f"simulated learner, steps 0:{steps}: {batch_size} prompts × {group_size} completions per step, statistics "
        f"{lag} step{'s' if lag != 1 else ''} behind the learner, seed {curriculum.seed}"
    )
    print("  latent difficulty of each source's records, from:")
    for source, origin in population.origin.items():
        print(f"    {source}: {origin}")
    result = simulate(
        curriculum,
        population,
        steps=steps,
        batch_size=batch_size,
        model=LearnerModel(group_size=group_size),
        lag=lag,
        seed=curriculum.seed,
        top=3,
    )
    held = sum(len(d) for d in population.held_out.values())
    print(
        f"  held-out pass rate: the learner's expected pass rate over a held-out draw of {held} records' "
        "difficulties, split evenly over those sources"
    )
    for run in result.stages:
        print(
            f"  {run.first:>6}–{run.stop - 1:<6} {run.name} ({run.sampler}): {run.stop - run.first} iterations, "
            f"held-out pass rate {run.held_out_start:.2f} → {run.held_out_end:.2f}, zero-variance groups "
            f"{run.zero_variance_share:.0%} of {run.groups}"
        )
        if run.mix_first is not None and run.mix_last is not None:
            first = ", ".join(f"{source} {w:.2f}" for source, w in run.mix_first.items())
            last = ", ".join(f"{source} {w:.2f}" for source, w in run.mix_last.items())
            print(f"  {'':>14} source weights: {first} → {last}")
        if run.top and all(r.pass_rate is None for r in run.top) and run.top[0].served == 1:
            print(f"  {'':>14} every record served once (an endless source keeps no per-record statistics)")
            continue
        cells = [
            f"{r.sample_id} ×{r.served} p̂ {r.pass_rate:.2f}"
            if r.pass_rate is not None
            else f"{r.sample_id} ×{r.served}"
            for r in run.top
        ]
        print(f"  {'':>14} served most: {', '.join(cells)}")
    if result.transitions:
        print("  transitions:")
        for t in result.transitions:
            frm, to = curriculum.stages[t.from_stage].name, curriculum.stages[t.to_stage].name
            print(f"    step {t.iteration}: {frm} → {to}: {t.reason}")
    else:
        print("  transitions: none")
    reached = result.steps_to(0.8)
    final = result.steps[-1].held_out if result.steps else result.initial_held_out
    when = f"80% reached after {reached} steps" if reached is not None else f"80% not reached in {steps} steps"
    print(
        f"  end: held-out pass rate {result.initial_held_out:.2f} → {final:.2f} ({when}), zero-variance groups "
        f"{result.zero_variance_share:.0%} of all"
    )
