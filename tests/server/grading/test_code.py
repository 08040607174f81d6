"""The ``code`` grader and its sandbox, against real sandboxed processes: verdicts, limits, and hostile programs.

Every hostile payload is bounded on its own (a loop that ends, a count of forks, a finite amount of output), so
that a sandbox that failed to contain it could not take the machine down.
"""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from proctor.server.curriculum.loader import load_curriculum
from proctor.server.exceptions import ProctorError
from proctor.server.grading.base import GradeInput, Verdict
from proctor.server.grading.code import code, program_of, read_tests
from proctor.server.grading.sandbox import Isolation, available_isolation
from proctor.server.spec import CurriculumError

needs_namespaces = pytest.mark.skipif(
    available_isolation() < Isolation.NAMESPACES, reason="the sandbox's namespaces need root where they are allowed"
)
pytestmark = needs_namespaces

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
FAST = {"wall_s": 8.0, "cpu_s": 2, "test_timeout_s": 2.0}


def grade(program: str, tests: list[Any] | None = None, **params: Any) -> Verdict:
    sample = GradeInput(prompt="p", completion=program, metadata={"tests": ADD_TESTS if tests is None else tests})
    return code(sample, **{**FAST, **params})


def test_a_right_program_passes_every_test() -> None:
    v = grade("```python\ndef add(a, b):\n    return a + b\n```")
    assert v.score == 1.0
    assert v.detail["tests"] == ["pass", "pass"]
    assert v.detail["failure"] is None
    assert v.detail["isolation"] == "namespaces"


def test_the_score_is_the_share_of_tests_passed_or_all_or_nothing() -> None:
    half = "def add(a, b):\n    return 5"
    assert grade(half).score == 0.5
    assert grade(half).detail["tests"] == ["pass", "fail"]
    assert grade(half, all_or_nothing=True).score == 0.0


def test_stdin_stdout_tests_compare_the_output() -> None:
    tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1", "output": "3"}]
    v = grade("a, b = map(int, input().split())\nprint(a + b)", tests)
    assert v.detail["tests"] == ["pass", "fail"]


def test_the_program_is_the_last_python_block_of_the_answer() -> None:
    sample = GradeInput(
        prompt="p", completion="<think>```python\nx = 1\n```</think>a\n```py\nx = 2\n```\n```js\nx\n```"
    )
    assert program_of(sample).strip() == "x = 2"
    assert program_of(GradeInput(prompt="p", completion="print(1)")) == "print(1)"


def test_a_syntax_error_fails_every_test_as_syntax() -> None:
    v = grade("def add(a, b) return a")
    assert v.score == 0.0
    assert v.detail["failure"] == "syntax"
    assert v.detail["tests"] == ["syntax", "syntax"]
    assert "SyntaxError" in v.detail["message"]


def test_an_exception_is_an_error_with_its_message() -> None:
    v = grade("def add(a, b):\n    raise KeyError('nope')")
    assert v.detail["tests"] == ["error", "error"]
    assert "KeyError" in v.detail["errors"]["0"]


def test_a_verdict_the_program_prints_is_not_taken() -> None:
    # Whatever it writes, on any stream, cannot pass a test: verdicts need the run's nonce.
    forged = 'import json, os\nfor fd in (1, 2, 3, 4, 5, 6):\n    try:\n        os.write(fd, b\'[0, "pass", ""]\\n\')\n'
    forged += "    except OSError:\n        pass\nos._exit(0)"
    v = grade(forged)
    assert v.score == 0.0
    assert v.detail["failure"] == "crash"
    assert "before its tests ran" in v.detail["message"]


# --- hostile programs: each gets a clean verdict within its limits ---------------------------------------------


def test_an_infinite_loop_times_out() -> None:
    v = grade("import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass")
    assert v.score == 0.0
    assert set(v.detail["tests"]) == {"timeout"}


def test_a_sleeping_program_times_out_on_the_wall_clock() -> None:
    v = grade("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(60)", wall_s=2.0)
    assert v.detail["failure"] == "timeout"
    assert set(v.detail["tests"]) == {"timeout"}


def test_a_storm_of_forks_is_capped_and_nothing_it_started_survives() -> None:
    storm = textwrap.dedent(
        """
        import os, time
        children = 0
        for _ in range(500):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
        def add(a, b):
            return children
        """
    )
    v = grade(storm, ["assert add(0, 0) < 16"], processes=16)
    assert v.detail["tests"] == ["pass"]  # the 16-process limit held
    assert not _sandbox_processes()


def test_a_10_gb_allocation_is_a_memory_verdict() -> None:
    v = grade("x = bytearray(10 * 1024**3)")
    assert set(v.detail["tests"]) == {"memory"}


def test_writing_outside_the_temp_dir_changes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    target.write_text("before")
    os.chmod(tmp_path, 0o777)
    os.chmod(target, 0o666)  # even a file anyone may write stays as it was
    program = textwrap.dedent(
        f"""
        import os
        wrote = []
        for path in ({str(target)!r}, "/tmp/proctor-sandbox-escape", "/etc/proctor-sandbox-escape",
                     os.path.expanduser("~/../proctor-sandbox-escape")):
            try:
                with open(path, "w") as f:
                    f.write("after")
                wrote.append(path)
            except OSError:
                pass
        with open("inside.txt", "w") as f:  # its own directory is writable
            f.write("ok")
        """
    )
    v = grade(program, ["assert wrote == []", "assert open('inside.txt').read() == 'ok'"])
    assert v.detail["tests"] == ["pass", "pass"]
    assert target.read_text() == "before"
    assert not Path("/tmp/proctor-sandbox-escape").exists()
    assert not Path("/etc/proctor-sandbox-escape").exists()


def test_no_socket_reaches_anything() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.2)
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        v = grade(program, ["assert True"])
        assert v.detail["tests"] == ["error"]
        assert "unreachable" in v.detail["errors"]["0"].lower()
        with pytest.raises(TimeoutError):
            server.accept()


def test_the_server_environment_is_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_SANDBOX_CANARY", "canary-4711")
    program = textwrap.dedent(
        """
        import os
        seen = str(dict(os.environ))
        try:
            seen += open("/proc/%d/environ" % os.getppid(), "rb").read().decode(errors="replace")
        except OSError:
            pass
        """
    )
    v = grade(program, ["assert 'canary-4711' not in seen", "assert 'PROCTOR' not in seen"])
    assert v.detail["tests"] == ["pass", "pass"]


def test_killing_the_parent_fails() -> None:
    v = grade("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)")
    assert set(v.detail["tests"]) == {"error"}
    assert "Operation not permitted" in v.detail["errors"]["0"]


def test_a_gigabyte_of_output_stops_at_the_output_limit() -> None:
    program = "import os, sys\nchunk = b'x' * 65536\nfor _ in range(16384):\n    os.write(1, chunk)"
    v = grade(program, output_kb=256)
    assert v.detail["failure"] == "output"
    assert set(v.detail["tests"]) == {"output"}
    printed = grade("for _ in range(16384):\n    print('y' * 65536)", output_kb=256)
    assert set(printed.detail["tests"]) == {"output"}


def test_a_file_past_its_limit_and_a_full_directory_are_errors() -> None:
    big = "with open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))"
    assert grade(big, file_mb=4).detail["errors"]["0"] == "OSError: [Errno 27] File too large"
    many = "for i in range(64):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * (1 << 20))"
    assert grade(many, file_mb=4, disk_mb=8).detail["errors"]["0"] == "OSError: [Errno 28] No space left on device"


def test_a_segfault_through_ctypes_is_a_crash() -> None:
    v = grade("import ctypes\nctypes.string_at(0)")
    assert v.detail["failure"] == "crash"
    assert "SIGSEGV" in v.detail["message"]


# --- what the grader refuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ([], "non-empty list"),
        ("not json", "not a JSON list"),
        (["assert x ==="], "test 0 is not valid Python"),
        (["assert True", {"input": "", "output": ""}], "mixes"),
        ([{"input": "1"}], "input and output"),
        ([""], "test 0 must be Python statements"),
    ],
)
def test_bad_tests_are_named(tests: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_tests(tests)


def test_tests_given_as_json_text_are_read() -> None:
    assert read_tests('["assert True"]') == ["assert True"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"isolation": "chroot"}, "isolation must be one of namespaces, uid, rlimits"),
        ({"memory_mb": 1}, r"memory_mb must be within \[32, 65536\]"),
        ({"wall_s": 0}, "wall_s and test_timeout_s"),
    ],
)
def test_bad_params_are_named(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        grade("x = 1", **params)


def test_a_code_record_without_tests_is_refused_when_the_curriculum_loads(tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "a", "tests": ["assert True"]}\n{"prompt": "b"}\n')
    (tmp_path / "c.yaml").write_text(
        textwrap.dedent(
            """
            name: code
            sources:
              tasks: {kind: jsonl, path: tasks.jsonl, answer_field: null, graders: [code]}
            stages: [{name: s, until_step: 10, mix: [{source: tasks, weight: 1}]}]
            """
        )
    )
    with pytest.raises(CurriculumError) as err:
        load_curriculum(tmp_path / "c.yaml")
    assert "sources.tasks.graders[0]" in str(err.value)
    assert "record 1's 'tests' must be a non-empty list" in str(err.value)


def test_an_endless_source_cannot_be_graded_by_code(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        "name: code\nsources:\n  a: {kind: arithmetic, graders: [code]}\n"
        "stages: [{name: s, until_step: 10, mix: [{source: a, weight: 1}]}]\n"
    )
    with pytest.raises(CurriculumError, match="source 'a' is endless; the code grader needs records with tests"):
        load_curriculum(tmp_path / "c.yaml")


def test_the_sandbox_error_is_a_proctor_error() -> None:
    from proctor.server.grading.sandbox import SandboxUnavailable

    assert issubclass(SandboxUnavailable, ProctorError)


def _sandbox_processes() -> list[int]:
    """Live processes of the sandbox's uid range."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
                state = Path(f"/proc/{entry.name}/stat").read_bytes().rpartition(b")")[2].split()[0]
            except OSError:
                continue
            if 1_900_000 <= uid < 1_901_024 and state not in (b"Z", b"X"):
                found.append(int(entry.name))
    return found
