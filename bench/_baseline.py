"""The version that benchmarks compare against: an earlier commit of this repository, read with git."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BASELINE", "available", "checkout", "old_module"]

ROOT = Path(__file__).resolve().parents[1]
# The version that before-and-after figures are measured against: the server without the fast math grader,
# per-chunk pool results and group commits.
BASELINE = "522d337"


def available(ref: str = BASELINE) -> bool:
    """Whether ``ref`` is in this clone (a shallow clone may lack it)."""
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}^{{commit}}"], capture_output=True)
    return found.returncode == 0


@contextlib.contextmanager
def checkout(ref: str = BASELINE) -> Iterator[tuple[dict[str, str], str]]:
    """A worktree of ``ref`` importable as ``proctor.*`` (a PYTHONPATH that shadows this checkout), and the
    module that runs its ``serve`` command."""
    with tempfile.TemporaryDirectory(prefix="proctor-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), ref], check=True)
        try:
            package = Path(tmp) / "path" / "proctor"
            package.mkdir(parents=True)
            # `dock` is the experience store's folder in commits from before it took that name.
            for name in ("server", "client", "curricula", "cli", "experience", "dock", "batching"):
                if (tree / name).is_dir():
                    (package / name).symlink_to(tree / name)
            module = "proctor.cli" if (tree / "cli").is_dir() else "proctor.server.cli"
            yield {"PYTHONPATH": str(package.parent)}, module
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def old_module(path: str, ref: str = BASELINE) -> types.ModuleType:
    """The file ``path`` as it was at ``ref``, loaded as a module of its own (its imports resolve to this
    checkout, so it suits a module whose dependencies did not change)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"baseline_{Path(path).stem}")
    module.__file__ = f"{ref}:{path}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # our own file at another commit
    return module
