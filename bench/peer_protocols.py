"""Other trainers' reward protocols against proctor's own ``/grade``, on the same completions, in one run.

A real dataserver process (the load curriculum: 5,000 arithmetic rows graded by ``math``) is driven over loopback
by 8 connections for a few seconds a route, each request's completions distinct from every other's (no cache can
help), every fourth one right:

- ``/grade``: 64 completions a request, named by sample id (no iteration);
- ``/score``: the same 64 completions, labelled by sample id;
- ``/openrlhf/reward``: the same 64, each a query (prompt + completion + ``<|im_end|>``) with its prompt and label;
- ``/slime/reward``: one completion a request, as slime sends them;
- ``/score`` unlabelled: 64 completions whose label is the answer, graded by the default source.

The routes take turns, a fifth of their time each round. Reported per route: requests/s, completions/s, p50 and
p99 latency (client side).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx

from bench._http import Connection
from bench._load import GRADE_ITEMS, Row, completion, drive, row, write_curriculum
from bench._results import save
from proctor.cli.launcher import ServerProcess

__all__ = ["main"]

CONCURRENCY = 8
ROUNDS = 5
SAMPLE_BATCH = 256
END = "<|im_end|>"


async def _run(host: str, port: int, seconds: float, answers: dict[str, str], prompts: dict[str, str]) -> list[Row]:
    setup = await Connection.open(host, port)
    served: list[str] = []
    for i in range(8):
        sampled = await setup.json("POST", "/sample", {"iteration": i, "batch_size": SAMPLE_BATCH})
        served.extend(s["sample_id"] for s in sampled["samples"])
    await setup.close()
    counter = itertools.count()

    def batch(n: int) -> list[tuple[str, str]]:
        """Request n's (sample id, completion) pairs, distinct from every other request's."""
        pairs = []
        for k in range(GRADE_ITEMS):
            sid = served[(n * GRADE_ITEMS + k) % len(served)]
            pairs.append((sid, completion(answers[sid], n, k, latex=False)))
        return pairs

    async def grade(c: Connection) -> None:
        items = [{"sample_id": sid, "completion": text} for sid, text in batch(next(counter))]
        await c.json("POST", "/grade", {"items": items})

    async def score(c: Connection) -> None:
        items = [{"response": text, "label": sid} for sid, text in batch(next(counter))]
        await c.json("POST", "/score", {"items": items})

    async def openrlhf(c: Connection) -> None:
        pairs = batch(next(counter))
        heads = [f"<|im_start|>user\n{prompts[sid]}{END}\n<|im_start|>assistant\n" for sid, _ in pairs]
        body = {
            "query": [head + text + END for head, (_, text) in zip(heads, pairs, strict=True)],
            "prompts": heads,
            "labels": [sid for sid, _ in pairs],
        }
        await c.json("POST", "/openrlhf/reward", body)

    slime_counter = itertools.count()

    async def slime(c: Connection) -> None:
        n = next(slime_counter)
        sid = served[n % len(served)]
        body = {"prompt": prompts[sid], "response": completion(answers[sid], n, n % 4, latex=False), "label": sid}
        await c.json("POST", "/slime/reward", body)

    async def unlabelled(c: Connection) -> None:
        items = [{"response": text, "label": answers[sid]} for sid, text in batch(next(counter))]
        await c.json("POST", "/score", {"items": items})

    routes: list[tuple[str, Callable[[Connection], Awaitable[None]]]] = [
        (f"/grade ({GRADE_ITEMS} completions by sample id)", grade),
        (f"/score ({GRADE_ITEMS} completions labelled by sample id)", score),
        (f"/openrlhf/reward ({GRADE_ITEMS} queries)", openrlhf),
        ("/slime/reward (1 completion)", slime),
        (f"/score ({GRADE_ITEMS} completions, the answer as label: default source)", unlabelled),
    ]
    # The routes take turns, a slice of their time each round, so that none runs on a store the others had
    # filled more (every completion named by a sample id is stored).
    latencies: dict[str, list[float]] = {name: [] for name, _ in routes}
    elapsed = dict.fromkeys(latencies, 0.0)
    for _ in range(ROUNDS):
        for name, fn in routes:
            times, took = await drive(fn, seconds=seconds / ROUNDS, concurrency=CONCURRENCY, host=host, port=port)
            latencies[name] += times
            elapsed[name] += took
    return [row(name, latencies[name], elapsed[name]) for name, _ in routes]


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| route | requests/s | completions/s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        per_request = 1 if r.name.startswith("/slime") else GRADE_ITEMS
        lines.append(
            f"| {r.name} | {r.per_second:,.0f} | {r.per_second * per_request:,.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench peer_protocols", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of load per route (default 5)")
    args = parser.parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="proctor-peers-") as tmp:
        path, rows = write_curriculum(Path(tmp))
        with ServerProcess(
            [str(path), "--database-url", str(Path(tmp) / "state.db"), "--log-level", "warning"],
            env={"PROCTOR_PEER_DEFAULT_SOURCE": "rows"},
            log=Path(tmp) / "server.log",
        ) as server:
            # Sample ids are `rows:<version>:<key>`, the key being the row's place in the file.
            version = next(s["version"] for s in httpx.get(server.url + "/meta").json()["sources"])
            answers = {f"rows:{version}:{n}": r["answer"] for n, r in enumerate(rows)}
            prompts = {f"rows:{version}:{n}": r["question"] for n, r in enumerate(rows)}
            host, port = server.url.removeprefix("http://").rsplit(":", 1)
            measured = asyncio.run(_run(host, int(port), args.seconds, answers, prompts))
    save("peer_protocols", {"machine": platform.platform(), "rows": [r.__dict__ for r in measured]})
    cores = len(os.sched_getaffinity(0))
    print(
        f"\nReward protocols against /grade: {CONCURRENCY} connections, {args.seconds:g} s a route, every "
        f"completion distinct, graded by math ({platform.machine()}, {cores} cores)"
    )
    print(table(measured))


if __name__ == "__main__":
    main(sys.argv[1:])
