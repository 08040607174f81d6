"""The README's curl examples, run verbatim against a real server, must print what the README shows."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def readme_examples() -> list[tuple[str, str, str]]:
    """(command, output language, expected output) for every curl line in the README's example section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- curl-examples:start -->", 1)[1].split("<!-- curl-examples:end -->", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL)
    examples = []
    for (lang, body), nxt in zip(blocks, [*blocks[1:], ("", "")], strict=True):
        if lang != "bash":
            continue
        for line in body.splitlines():
            if line.startswith("curl "):
                out_lang, out = nxt
                examples.append((line, out_lang, out))
    return examples


def test_the_readme_has_examples() -> None:
    assert len(readme_examples()) >= 8
    assert "export PROCTOR_URL=http://127.0.0.1:8000" in (ROOT / "README.md").read_text()


def test_readme_curl_lines(server_process: Callable[..., Any], tmp_path: Path) -> None:
    server = server_process(["curricula/arithmetic.yaml", "--state", str(tmp_path / "state.db")], cwd=ROOT)
    for command, out_lang, expected in readme_examples():
        result = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "PROCTOR_URL": server.url},
            timeout=30,
        )
        assert result.returncode == 0, (command, result.stderr)
        if out_lang == "json":
            assert json.loads(result.stdout) == json.loads(expected), command
        else:
            assert result.stdout.strip() == expected.strip(), command
