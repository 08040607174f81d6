"""Architecture rules that imports alone can break."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_wire_models_import_without_fastapi() -> None:
    modules = imported_after("import proctor.wire.dataserver")
    assert "fastapi" not in modules
    assert "starlette" not in modules


def test_the_server_and_the_command_line_never_import_torch() -> None:
    modules = imported_after("import proctor.server.app, proctor.cli.main, proctor.server.grading.builtin")
    assert "torch" not in modules
    assert "transformers" not in modules


def test_the_server_never_imports_the_client() -> None:
    # Every module of proctor.server, imported in one fresh interpreter.
    modules = imported_after(
        "import importlib, pkgutil, proctor.server; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(proctor.server.__path__, 'proctor.server.')]"
    )
    assert "proctor.server.app" in modules  # the walk did import the package
    assert not {m for m in modules if m == "proctor.client" or m.startswith("proctor.client.")}
    assert "torch" not in modules
    # A lazy import inside a function would escape the check above.
    mentions = [str(f.relative_to(ROOT)) for f in (ROOT / "server").rglob("*.py") if "proctor.client" in f.read_text()]
    assert not mentions, f"server/ must not import proctor.client: {mentions}"


def test_the_experience_store_imports_neither_side_nor_a_web_framework() -> None:
    # The server and the client both import proctor.experience (and proctor.batching): it must need neither of them.
    modules = imported_after("import proctor.experience, proctor.wire.experience, proctor.batching.dynamic")
    assert not {m for m in modules if m.startswith(("proctor.server", "proctor.client"))}
    assert not {"fastapi", "starlette", "torch"} & modules


def test_the_client_imports_without_the_deep_learning_stack() -> None:
    # Everything proctor.client exports, its lazy names included; only proctor.client.training needs torch and TRL.
    modules = imported_after(
        "import proctor.client as c; [getattr(c, name) for name in c.__all__]; import proctor.client.training"
    )
    assert "proctor.client.dataset" in modules  # the lazy names were reached
    assert not {"torch", "transformers", "trl", "accelerate"} & modules
    assert not {m for m in modules if m.startswith("proctor.server")}


def test_every_package_of_the_source_roots_is_installed() -> None:
    # pyproject.toml lists the packages one by one: a folder left out (code, or data such as the live page's
    # files) would be missing from the wheel.
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    files = [ROOT / line for line in tracked.stdout.split()]
    found = set()
    for name, folder in roots.items():
        for file in files:
            if folder in file.parents:
                found.add(".".join((name, *file.parent.relative_to(folder).parts)))
    assert found == set(setuptools["packages"])
    # Each root's folder is where its name says, below its source root.
    for name, folder in roots.items():
        if name != "proctor.curricula":
            assert folder.relative_to(ROOT).parts[1:] == tuple(name.split("."))
