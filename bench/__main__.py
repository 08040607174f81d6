"""``python -m bench [NAME ...]``: the benchmarks, one after the other, each printing its table.

Names: server_load, trainer_overhead, batching, grpo_step (default: all).
"""

from __future__ import annotations

import sys

from bench import server_load

if __name__ == "__main__":
    only = set(sys.argv[1:])
    if not only or "server_load" in only:
        server_load.main()
    # Imported when run: these need the `train` extra (torch, TRL), the server benchmark does not.
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
