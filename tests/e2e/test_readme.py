"""The README and the docs as a new user follows them: the README's ``make serve``, then the curl tour and
training of docs/getting-started.md, each line run verbatim.

The blocks run sit between HTML comment markers (``<!-- NAME:start -->`` … ``<!-- NAME:end -->``), in the README
or in any page under docs/. The curl lines must print what the page shows under them. Then the training section
runs in its order: ``make train`` against the run the tour used stops with the one line the page shows, and
after ``make serve ARGS=--fresh`` it trains. The servers take a free port and a temporary state folder from the
environment (``PROCTOR_PORT``, ``PROCTOR_STATE_DIR``), which the documented commands leave to it. The README's
TRL script runs too, on the tiny offline model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import free_port
from proctor.client.tiny import run_defaults
from tests.conftest import system_command

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "\n".join(page.read_text() for page in PAGES)  # the README, then every docs page
pytestmark = pytest.mark.e2e


def section(name: str) -> str:
    """The text between a marker pair; each marker is in exactly one page, once."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    assert TEXT.count(start) == 1 and TEXT.count(end) == 1, name
    return TEXT.split(start, 1)[1].split(end, 1)[0]


def commands(name: str) -> list[str]:
    """The command lines of a marked section's bash blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", section(name), flags=re.DOTALL)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def readme_examples() -> list[tuple[str, str, str]]:
    """(command, output language, expected output) for every curl line in the docs' example section."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", section("curl-examples"), flags=re.DOTALL)
    examples = []
    for (lang, body), nxt in zip(blocks, [*blocks[1:], ("", "")], strict=True):
        if lang != "bash":
            continue
        for line in body.splitlines():
            if line.startswith("curl "):
                out_lang, out = nxt
                examples.append((line, out_lang, out))
    return examples


class Terminal:
    """Runs documented lines as a user's shell would, in the checkout, with the test's port and state folder."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.server: subprocess.Popen[str] | None = None
        self.url = env["PROCTOR_URL"]

    def start_server(self, line: str) -> None:
        """A ``make serve …`` line, in the background until the next one, as in a terminal of its own."""
        self.stop_server()
        self.server = subprocess.Popen(
            ["bash", "-c", line],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120  # a liveness bound: make may install first
        while True:
            assert self.server.poll() is None, f"{line} exited:\n{self.server.communicate()[0]}"
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{line}: no server answered"
            time.sleep(0.2)

    def stop_server(self) -> str:
        """Ctrl-C: SIGINT to the server's whole process group; returns what it printed."""
        if self.server is None:
            return ""
        os.killpg(self.server.pid, signal.SIGINT)
        out = self.server.communicate(timeout=60)[0]
        self.server = None
        return out

    def run(self, line: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", line], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    port = free_port()
    env = {
        **os.environ,
        "PROCTOR_PORT": str(port),
        "PROCTOR_URL": f"http://127.0.0.1:{port}",
        "PROCTOR_STATE_DIR": str(tmp_path / "runs"),
        "PROCTOR_GRADER_WORKERS": "1",
    }
    term = Terminal(env)
    yield term
    term.stop_server()


def test_the_readme_and_docs_have_their_sections() -> None:
    assert commands("quick-start") == ["make serve", "make test"]
    assert len(readme_examples()) >= 8
    assert "export PROCTOR_URL=http://127.0.0.1:8000" in section("curl-examples")
    assert [c.split()[:2] for c in commands("train-example")] == [["make", "serve"], ["make", "train"]]


def test_the_readme_and_docs_run_as_written(terminal: Terminal) -> None:
    system_command("curl")
    [serve, _test] = commands("quick-start")
    terminal.start_server(serve)

    for command, out_lang, expected in readme_examples():
        # `export PROCTOR_URL=…` is the page's: the test's server is on the port it chose.
        result = terminal.run(command, timeout=30)
        assert result.returncode == 0, (command, result.stderr)
        if out_lang == "json":
            assert json.loads(result.stdout) == json.loads(expected), command
        else:
            assert result.stdout.strip() == expected.strip(), command

    fresh, train = commands("train-example")
    # Training against the run the tour used stops with the one line the page shows.
    refused = terminal.run(train)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    [shown] = [line for line in TEXT.splitlines() if line.startswith("proctor train: error: the dataserver's run")]
    pattern = ".*?".join(re.escape(part) for part in shown.split("…"))
    errors = [line for line in refused.stderr.splitlines() if line.startswith("proctor train: error:")]
    assert len(errors) == 1 and re.fullmatch(pattern, errors[0]), refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr

    terminal.stop_server()
    terminal.start_server(fresh)
    trained = terminal.run(train)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    steps = [line for line in trained.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 8
    assert "stage one_digit" in steps[0]
    # Its output is its own lines: no library warnings, progress bars or tracebacks.
    assert trained.stderr == "", trained.stderr
    log = terminal.stop_server()
    assert "--fresh: removed the run's state file" in log


def test_the_readmes_trl_script_trains(
    live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's script as written, on the tiny offline model and a CPU-sized run: the model id and the
    # server's URL are swapped for the test's, and GRPOConfig takes the test's sizes over the script's.
    import trl

    [script] = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert script.count('"Qwen/Qwen2.5-0.5B-Instruct"') == 1 and script.count('"http://127.0.0.1:8000"') == 1
    sizes = {
        **run_defaults(tmp_path / "run"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
    }
    real = trl.GRPOConfig  # type: ignore[attr-defined]  # trl's __init__ does not re-export them
    monkeypatch.setattr(trl, "GRPOConfig", lambda **values: real(**{**values, **sizes}))
    with live_server() as url:
        script = script.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(tiny_model)))
        names: dict[str, Any] = {}
        try:
            exec(compile(script.replace('"http://127.0.0.1:8000"', repr(url)), "README.md", "exec"), names)
        finally:
            if "client" in names:
                names["client"].close()
        state = httpx.get(url + "/curriculum").json()
    # Two steps of one generation each (4 completions), graded through the store.
    assert sum(stage["graded"] for stage in state["stages"]) == 2 * 4
