"""``python -m bench [NAME [FLAG ...] ...]``: the benchmarks, one after the other, each printing its table.

Names: math_grader, server_load, rollout_path, replicas, event_loop, memory_soak, experience_throughput, grading_roles,
peer_protocols, regrade, curriculum_sim, learning_run, curriculum_run, trainer_overhead, batching, grpo_step, judge,
sandbox (default: all).
The flags after a name, up to the next name, are that benchmark's own (``python -m bench memory_soak --quick
server_load --no-baseline``). Run with the others (no name given), memory_soak soaks at a smaller size (see
bench/memory_soak.py).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from bench import (
    curriculum_sim,
    event_loop,
    experience_throughput,
    math_grader,
    memory_soak,
    peer_protocols,
    regrade,
    replicas,
    rollout_path,
    server_load,
)

NAMES = (
    "math_grader",
    "server_load",
    "rollout_path",
    "replicas",
    "event_loop",
    "memory_soak",
    "experience_throughput",
    "grading_roles",
    "peer_protocols",
    "regrade",
    "curriculum_sim",
    "learning_run",
    "curriculum_run",
    "trainer_overhead",
    "batching",
    "grpo_step",
    "judge",
    "sandbox",
)
# Their main() reads no command line, so a flag after one of these names would be silently dropped.
FLAGLESS = ("math_grader", "event_loop", "batching")


def flags_after(name: str, args: Sequence[str]) -> list[str]:
    """What follows ``name`` in ``args`` up to the next benchmark's name: that benchmark's flags."""
    if name not in args:
        return []
    return list(itertools.takewhile(lambda a: a not in NAMES, args[args.index(name) + 1 :]))


def main(args: Sequence[str]) -> None:
    if args and args[0] not in NAMES:
        sys.exit(f"python -m bench: {args[0]!r} is not a benchmark ({', '.join(NAMES)}); flags follow a name")
    for name in FLAGLESS:
        if flags := flags_after(name, args):
            sys.exit(f"python -m bench: {name} takes no flags, got {' '.join(flags)}")
    only = set(args) & set(NAMES)
    if not only or "math_grader" in only:
        math_grader.main()
    if not only or "server_load" in only:
        server_load.main(flags_after("server_load", args))
    if not only or "rollout_path" in only:
        rollout_path.main(flags_after("rollout_path", args))
    if not only or "replicas" in only:
        replicas.main(flags_after("replicas", args))
    if not only or "event_loop" in only:
        event_loop.main()
    if not only or "memory_soak" in only:
        # Named, it runs the full size (or its flags); in the all-benchmarks run, a smaller one.
        memory_soak.main(flags_after("memory_soak", args) if only else memory_soak.ALL_BENCHMARKS_ARGS)
    if not only or "experience_throughput" in only:
        experience_throughput.main(flags_after("experience_throughput", args))
    if not only or "grading_roles" in only:
        from bench import grading_roles  # its overlap part needs the `train` extra

        grading_roles.main(flags_after("grading_roles", args))
    if not only or "peer_protocols" in only:
        peer_protocols.main(flags_after("peer_protocols", args))
    if not only or "regrade" in only:
        regrade.main(flags_after("regrade", args))
    if not only or "curriculum_sim" in only:
        curriculum_sim.main(flags_after("curriculum_sim", args))
    # Imported when run: these need the `train` extra (torch, TRL), the server benchmarks do not.
    if not only or "learning_run" in only:
        from bench import learning_run

        learning_run.main(flags_after("learning_run", args))
    if not only or "curriculum_run" in only:
        from bench import curriculum_run

        curriculum_run.main(flags_after("curriculum_run", args))
    if not only or "trainer_overhead" in only:
        from bench import trainer_overhead

        trainer_overhead.main(flags_after("trainer_overhead", args))
    if not only or "batching" in only:
        from bench import batching

        batching.main()
    if not only or "grpo_step" in only:
        from bench import grpo_step

        sys.argv = [sys.argv[0], *flags_after("grpo_step", args)]  # grpo_step parses sys.argv itself
        grpo_step.main()
    if not only or "judge" in only:
        from bench import judge  # transformers serve: the `train` extra, and openai (the dev extra)

        judge.main(flags_after("judge", args))
    if not only or "sandbox" in only:
        from bench import sandbox

        sandbox.main(flags_after("sandbox", args))


if __name__ == "__main__":
    main(sys.argv[1:])
