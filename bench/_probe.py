"""A /healthz prober in a process of its own: ``python -m bench._probe PORT SECONDS [INTERVAL_S]``.

A probe that shares its event loop with a load generator measures that loop too: while it decodes a burst of
answers and builds the next requests, a probe's answer waits in the client. In a process of its own, the
probe's latency is the server's. Prints the latencies, in seconds, as one JSON list.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from bench._http import Connection

__all__ = ["probe"]


async def probe(port: int, seconds: float, interval_s: float = 0.01) -> list[float]:
    """``GET /healthz`` every ``interval_s`` for ``seconds``; each answer's latency."""
    conn = await Connection.open("127.0.0.1", port)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await conn.json("GET", "/healthz")
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(interval_s)
    finally:
        await conn.close()
    return latencies


if __name__ == "__main__":
    port, seconds, *rest = sys.argv[1:]
    print(json.dumps(asyncio.run(probe(int(port), float(seconds), *(float(r) for r in rest)))))
