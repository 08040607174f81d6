"""``proctor demo``: serve the arithmetic ladder in a child process and train the tiny model against it.

Needs the ``train`` extra (torch, transformers, TRL); ``proctor.cli.main`` imports this module only for ``demo``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from proctor.cli.launcher import ServerProcess
from proctor.client.training.command import build_parser, train
from proctor.server.shipped import builtin_path

__all__ = ["demo"]


def demo(steps: int = 64) -> int:
    """Serve the arithmetic ladder and train the tiny model across its stage boundaries at iterations 20 and 60
    (or as many as ``steps`` reaches); returns 0 when at least one transition happened."""
    with tempfile.TemporaryDirectory(prefix="proctor-demo-") as tmp:
        log = Path(tmp) / "server.log"
        with ServerProcess([str(builtin_path("arithmetic")), "--database-url", ":memory:"], log=log) as server:
            print(f"dataserver on {server.url}, serving the arithmetic ladder", flush=True)
            args = build_parser().parse_args(
                ["--server", server.url, "--max-steps", str(steps), "--output-dir", str(Path(tmp) / "run")]
            )
            try:
                summary = train(args)
            except (Exception, SystemExit):
                # The server's log goes with the temporary folder: show its end while it is still there.
                print(f"the dataserver's last lines:\n{server.stop()[-2000:]}", file=sys.stderr)
                raise
    crossed = any(t["iteration"] <= steps for t in summary["transitions"])
    return 0 if crossed else 1
