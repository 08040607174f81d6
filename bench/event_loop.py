"""How long one request can hold the server's event loop: the heaviest requests its limits allow.

For each kind of request (the largest valid /grade, a body of the largest size built to be slow to parse,
the largest /sample batch, the largest iteration), one connection sends it while another probes
``/healthz`` every 2 ms; the longest probe is how long that request kept every other client waiting.
Each kind is sent several times on a real server process with its state on disk and the default limits
(``PROCTOR_MAX_BODY_BYTES``, ``PROCTOR_MAX_GRADE_ITEMS``, ``PROCTOR_MAX_BATCH_SIZE``).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._http import Connection
from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.server.settings import Settings
from proctor.wire.dataserver import MAX_ITERATION

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Settings.model_fields
BODY_LIMIT: int = LIMITS["max_body_bytes"].default
ITEMS: int = LIMITS["max_grade_items"].default
BATCH: int = LIMITS["max_batch_size"].default
SAMPLE_ID = "add_1d:d03351e4be:{}"
TARGET_MS = 100.0


@dataclass
class Row:
    request: str
    status: int
    body_mib: float
    runs: int
    request_ms: float  # median time to answer the request itself
    worst_probe_ms: float  # the longest /healthz probe while it ran, over all runs
    median_worst_probe_ms: float


def _grade(items: list[dict[str, object]], iteration: int) -> bytes:
    return json.dumps({"iteration": iteration, "items": items}).encode()


def _kinds(runs: int) -> list[tuple[str, str, Callable[[int], bytes]]]:
    """(name, path, body of run k): every run is a fresh request, so nothing is answered from a cache."""
    per_item = (BODY_LIMIT - 64 * 1024) // ITEMS - 70
    bomb = b"[1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0],"
    values = (BODY_LIMIT - 64) // len(bomb)
    return [
        (
            f"/grade, {ITEMS} short completions",
            "/grade",
            lambda k: _grade([{"sample_id": SAMPLE_ID.format(i), "completion": f"{k}-{i}"} for i in range(ITEMS)], k),
        ),
        (
            f"/grade, {ITEMS} completions filling the body limit",
            "/grade",
            lambda k: _grade(
                [
                    {"sample_id": SAMPLE_ID.format(i), "completion": f"{k}-{i}".ljust(per_item, "x")}
                    for i in range(ITEMS)
                ],
                runs + k,
            ),
        ),
        (
            "/grade, a body-limit's worth of small JSON values as items (refused, 422)",
            "/grade",
            lambda k: b'{"items": [' + bomb * (values - 1) + b"[]]}",
        ),
        (
            "/grade, a body-limit's worth of small JSON values in an ignored field",
            "/grade",
            lambda k: b'{"items": [], "padding": [' + bomb * (values - 1) + b"[]]}",
        ),
        (
            f"/sample, a new iteration of batch {BATCH}",
            "/sample",
            lambda k: json.dumps({"iteration": 1000 + k, "batch_size": BATCH}).encode(),
        ),
        (
            f"/sample, iteration 2^53 - 1 - k, batch {BATCH}",
            "/sample",
            lambda k: json.dumps({"iteration": MAX_ITERATION - k, "batch_size": BATCH}).encode(),
        ),
    ]


async def _post(host: str, port: int, path: str, body: bytes) -> int:
    conn = await Connection.open(host, port)  # its own connection, so that the probe's is never behind it
    status, _ = await conn.send("POST", path, body)
    await conn.close()
    return status


async def _measure(host: str, port: int, runs: int) -> list[Row]:
    probe = await Connection.open(host, port)
    rows: list[Row] = []
    for name, path, make in _kinds(runs):
        worst: list[float] = []
        took: list[float] = []
        statuses: set[int] = set()
        size = 0
        for k in range(runs):
            body = make(k)
            size = len(body)
            probes: list[float] = []
            started = time.perf_counter()
            task = asyncio.create_task(_post(host, port, path, body))
            while not task.done():
                t = time.perf_counter()
                await probe.request("GET", "/healthz")
                probes.append(time.perf_counter() - t)
                await asyncio.sleep(0.002)
            statuses.add(await task)
            took.append(time.perf_counter() - started)
            worst.append(max(probes))
            await asyncio.sleep(0.2)  # let the graders drain before the next run
        rows.append(
            Row(
                request=name,
                status=min(statuses) if len(statuses) == 1 else -1,
                body_mib=size / 2**20,
                runs=runs,
                request_ms=statistics.median(took) * 1e3,
                worst_probe_ms=max(worst) * 1e3,
                median_worst_probe_ms=statistics.median(worst) * 1e3,
            )
        )
    await probe.close()
    return rows


def run(runs: int = 5) -> tuple[list[Row], dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["curricula/arithmetic.yaml", "--database-url", str(Path(tmp) / "state.db"), "--log-level", "warning"]
        with ServerProcess(args, log=Path(tmp) / "server.log", cwd=ROOT) as server:
            rows = asyncio.run(_measure("127.0.0.1", server.port, runs))
    env: dict[str, object] = {"cpus": os.cpu_count(), "python": platform.python_version(), "runs": runs}
    return rows, env


def table(rows: list[Row]) -> str:
    lines = [
        "| request | status | body MiB | request ms (median) | longest /healthz wait ms: median run | worst run |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.request} | {r.status} | {r.body_mib:.2f} | {r.request_ms:.0f} | {r.median_worst_probe_ms:.1f} | "
            f"{r.worst_probe_ms:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    rows, env = run()
    print(f"event-loop hold per request, {env['runs']} runs each, {env['cpus']} CPUs, Python {env['python']}")
    print(table(rows))
    worst = max(r.worst_probe_ms for r in rows)
    print(f"longest wait of any probe: {worst:.1f} ms (goal ≤ {TARGET_MS:.0f} ms)")
    save("event_loop", {"env": env, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
