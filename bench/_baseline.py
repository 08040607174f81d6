"""The version that benchmarks compare against: an earlier commit of this repository, read with git."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import tomllib
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
            path = Path(tmp) / "path"
            (path / "proctor").mkdir(parents=True)
            for package, where in _packages(tree).items():
                (path / package.replace(".", "/")).symlink_to(tree / where, target_is_directory=True)
            module = "proctor.cli" if (tree / "cli").is_dir() else "proctor.server.cli"
            yield {"PYTHONPATH": str(path)}, module
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def _packages(tree: Path) -> dict[str, str]:
    """Where each of ``proctor``'s packages is in ``tree``: pyproject.toml's ``package-dir``, or, in commits from
    before it had one, a folder per package at the top."""
    config = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    mapped: dict[str, str] = config.get("package-dir", {})
    if mapped:
        return {name: where for name, where in mapped.items() if name.count(".") == 1}
    # `dock` is the experience store's folder in commits from before it took that name.
    names = ("server", "client", "curricula", "cli", "experience", "dock", "batching")
    return {f"proctor.{name}": name for name in names if (tree / name).is_dir()}


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
