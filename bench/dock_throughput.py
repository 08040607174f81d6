"""The experience store's throughput: rows per second written and read, in-process (``TransferDock`` on a
file) and through the dataserver's ``/dock`` routes (``DockClient``), side by side in one run.

Each step is a 1,024-row table (256 prompts × 4 completions) with a 512-token ``completion_ids`` column,
stored either as int32 arrays (the store's binary encoding: raw bytes in SQLite, base64 on the wire) or as
JSON lists of integers. A write is one ``put`` of every row's cell; a read is one ``read`` of them all.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.client import DockClient
from proctor.dock import TransferDock

SLOTS, GROUP, TOKENS = 256, 4, 512
ROWS = SLOTS * GROUP


def _columns(step: int, encoding: str) -> dict[str, list[Any]]:
    rng = np.random.default_rng(step)
    ids = [rng.integers(0, 150_000, TOKENS, dtype=np.int32) for _ in range(ROWS)]
    return {"completion_ids": ids if encoding == "binary" else [a.tolist() for a in ids]}


def _measure(dock: TransferDock | DockClient, encoding: str, steps: int, first: int = 0) -> dict[str, float]:
    rows = [(s, k) for s in range(SLOTS) for k in range(GROUP)]
    write_s, read_s = [], []
    for step in range(first, first + steps):
        columns = _columns(step, encoding)
        dock.open(step, slots=SLOTS, group_size=GROUP)
        t0 = time.perf_counter()
        dock.put(step, rows, columns)
        write_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dock.read(step, rows, ["completion_ids"])
        read_s.append(time.perf_counter() - t0)
    return {
        "write_rows_per_s": ROWS / statistics.median(write_s),
        "read_rows_per_s": ROWS / statistics.median(read_s),
    }


def run(steps: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for encoding in ("binary", "json"):
            dock = TransferDock(Path(tmp, f"inproc-{encoding}.db"), keep_iterations=steps + 1)
            try:
                results.append({"face": "in-process", "encoding": encoding, **_measure(dock, encoding, steps)})
            finally:
                dock.close()
        server = ServerProcess(
            ["--state", str(Path(tmp, "server.db")), "--grader-workers", "0"],
            log=Path(tmp, "server.log"),
            env={"PROCTOR_DOCK_KEEP_ITERATIONS": str(2 * steps + 1)},
        ).start()
        try:
            for n, encoding in enumerate(("binary", "json")):
                with DockClient(server.url) as client:
                    results.append(
                        {"face": "HTTP", "encoding": encoding, **_measure(client, encoding, steps, n * steps)}
                    )
        finally:
            server.stop()
    return results


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"| {ROWS:,}-row steps, {TOKENS}-token completion_ids | written, rows/s | read, rows/s |",
        "|---|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['face']}, {r['encoding']} | {r['write_rows_per_s']:,.0f} | {r['read_rows_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench dock_throughput")
    parser.add_argument("--steps", type=int, default=5, help="tables written and read per variant (median)")
    args = parser.parse_args(list(argv))
    results = run(args.steps)
    save("dock_throughput", results)
    print(table(results))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
