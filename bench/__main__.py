"""``python -m bench [NAME ...]``: the benchmarks, one after the other, each printing its table.

Names: math_grader, server_load, event_loop, memory_soak, trainer_overhead, batching, grpo_step (default: all).
Flags after ``memory_soak`` are its own (``python -m bench memory_soak --quick``); run with the others, it
soaks at a smaller size (see bench/memory_soak.py).
"""

from __future__ import annotations

import sys

from bench import event_loop, math_grader, memory_soak, server_load

NAMES = ("math_grader", "server_load", "event_loop", "memory_soak", "trainer_overhead", "batching", "grpo_step")

if __name__ == "__main__":
    only = set(sys.argv[1:])
    if not only or "math_grader" in only:
        math_grader.main()
    if not only or "server_load" in only:
        server_load.main()
    if not only or "event_loop" in only:
        event_loop.main()
    if not only or "memory_soak" in only:
        # Named, it runs the full size (or its flags); in the all-benchmarks run, a smaller one.
        flags = [a for a in sys.argv[sys.argv.index("memory_soak") + 1 :] if a not in NAMES] if only else None
        memory_soak.main(memory_soak.ALL_BENCHMARKS_ARGS if flags is None else flags)
    # Imported when run: these need the `train` extra (torch, TRL), the server benchmarks do not.
    if not only or "trainer_overhead" in only:
        from bench import trainer_overhead

        trainer_overhead.main()
    if not only or "batching" in only:
        from bench import batching

        batching.main()
    if not only or "grpo_step" in only:
        from bench import grpo_step

        sys.argv = sys.argv[:1]  # grpo_step parses its own (empty) command line
        grpo_step.main()
