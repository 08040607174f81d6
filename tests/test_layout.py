"""Architecture rules that imports alone can break."""

from __future__ import annotations

import subprocess
import sys


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_wire_models_import_without_fastapi() -> None:
    modules = imported_after("import proctor.server.protocol")
    assert "fastapi" not in modules
    assert "starlette" not in modules


def test_the_server_never_imports_torch() -> None:
    modules = imported_after("import proctor.server.app, proctor.server.cli, proctor.server.grading.builtin")
    assert "torch" not in modules
    assert "transformers" not in modules
