"""``proctor export``: a dataserver's kept rollouts to a parquet or JSON-lines file."""

from __future__ import annotations

import argparse
import os
import sys

from proctor.client.errors import DataserverError
from proctor.client.experience import ExperienceClient
from proctor.client.export import export_rollouts
from proctor.client.http import ProctorClient

__all__ = ["export", "iteration_range"]


def iteration_range(text: str) -> range | None:
    """``A:B`` (B excluded; either may be left out) as a range; ``:`` is every iteration (None)."""
    start, sep, stop = text.partition(":")
    if not sep:
        raise ValueError(f"--iterations {text!r}: give START:STOP, e.g. 10:20 (STOP excluded), or : for all")
    try:
        low = int(start) if start else 0
        high = int(stop) if stop else 2**62
    except ValueError:
        raise ValueError(f"--iterations {text!r}: START and STOP are whole numbers, e.g. 10:20") from None
    if low < 0 or high < low:
        raise ValueError(f"--iterations {text!r}: need 0 ≤ START ≤ STOP")
    return None if (not start and not stop) else range(low, high)


def export(args: argparse.Namespace) -> int:
    try:
        iterations = iteration_range(args.iterations)
    except ValueError as exc:
        print(f"proctor export: {exc}", file=sys.stderr)
        return 2
    # A command run by hand: two retries (under a second) ride out a blip, where a trainer's client waits out
    # a restarting server for 15 s, and the answer to a wrong --server comes at once.
    client = ProctorClient(args.server, api_key=args.api_key or os.environ.get("PROCTOR_API_KEY"), retries=2)
    try:
        rows = export_rollouts(
            ExperienceClient(client=client),
            args.out,
            iterations=iterations,
            stages=args.stage,
            sources=args.source,
            format=args.format,
        )
    except ValueError as exc:
        print(f"proctor export: {exc}", file=sys.stderr)
        return 2
    except DataserverError as exc:
        print(f"proctor export: the dataserver at {args.server} did not answer as asked: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    print(f"wrote {rows} rows to {args.out}")
    return 0
