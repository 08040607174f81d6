"""``python -m bench``: every benchmark, one after the other, each printing its table."""

from __future__ import annotations

import sys

from bench import server_load

if __name__ == "__main__":
    only = set(sys.argv[1:])  # e.g. `python -m bench trainer_overhead`
    if not only or "server_load" in only:
        server_load.main()
    if not only or "trainer_overhead" in only:
        # Imported here: it needs the `train` extra (torch, TRL), the server benchmark does not.
        from bench import trainer_overhead

        trainer_overhead.main()
