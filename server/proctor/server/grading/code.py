"""The ``code`` grader: a completion's Python run against its record's tests in a sandbox
(:mod:`proctor.server.grading.sandbox`).

A record's ``tests`` (its metadata field, ``tests_field`` to read another) are either Python statements run after
the program in its namespace (``"assert add(2, 3) == 5"``), or ``{"input": …, "output": …}`` pairs: the program
runs once per pair with ``input`` as its stdin, and passes when its stdout equals ``output`` (trailing whitespace
aside). A file source may hold them as a list or as the JSON text of one (CSV). The program is the last fenced
code block of the answer (the text after a leading ``<think>…</think>``), or the whole answer when it has none.

The score is the share of tests passed (``all_or_nothing: true``: 1.0 or 0.0); the detail says each test's
verdict and why the run ended early, if it did.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from proctor.server.grading.base import GradeInput, Verdict
from proctor.server.grading.sandbox import Isolation, SandboxLimits, Test, run_program

__all__ = ["MAX_TESTS", "code", "program_of", "read_tests"]

MAX_TESTS = 256
_DEFAULT = SandboxLimits()  # the limits a run gets where the curriculum sets none
_MAX_TEST_CHARS = 64 * 1024
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")


def program_of(sample: GradeInput) -> str:
    """The program in a completion: its answer's last fenced Python (or untagged) block, else the whole answer."""
    blocks = [body for tag, body in _FENCE.findall(sample.response) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else sample.response


def read_tests(value: Any) -> list[Test]:
    """A record's tests, checked; raises ``ValueError`` saying what is wrong with them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("is text that is not a JSON list of tests") from None
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of tests (Python statements, or {input, output} pairs)")
    if len(value) > MAX_TESTS:
        raise ValueError(f"holds {len(value)} tests; at most {MAX_TESTS}")
    statements = [isinstance(t, str) for t in value]
    if all(statements):
        for n, t in enumerate(value):
            if not t.strip() or len(t) > _MAX_TEST_CHARS:
                raise ValueError(f"test {n} must be Python statements of 1 to {_MAX_TEST_CHARS} characters")
            try:
                compile(t, f"<test {n}>", "exec")
            except (SyntaxError, ValueError) as exc:
                raise ValueError(f"test {n} is not valid Python: {exc}") from None
        return list(value)
    if any(statements):
        raise ValueError("mixes Python statements with {input, output} pairs; a record's tests are of one kind")
    for n, t in enumerate(value):
        if (
            not isinstance(t, dict)
            or set(t) != {"input", "output"}
            or not all(isinstance(v, str) and len(v) <= _MAX_TEST_CHARS for v in t.values())
        ):
            raise ValueError(f"test {n} must be Python statements or an object of two strings, input and output")
    return [{"input": t["input"], "output": t["output"]} for t in value]


def code(
    sample: GradeInput,
    /,
    *,
    tests_field: str = "tests",
    all_or_nothing: bool = False,
    isolation: str = "namespaces",
    python: str | None = None,
    wall_s: float = _DEFAULT.wall_s,
    cpu_s: int = _DEFAULT.cpu_s,
    test_timeout_s: float = _DEFAULT.test_timeout_s,
    memory_mb: int = _DEFAULT.memory_mb,
    processes: int = _DEFAULT.processes,
    open_files: int = _DEFAULT.open_files,
    file_mb: int = _DEFAULT.file_mb,
    disk_mb: int = _DEFAULT.disk_mb,
    output_kb: int = _DEFAULT.output_kb,
) -> Verdict:
    """Run the completion's program against the record's tests in a sandbox; see the module's docstring."""
    try:
        required = Isolation[isolation.upper()]
    except KeyError:
        raise ValueError(f"isolation must be one of namespaces, uid, rlimits; got {isolation!r}") from None
    bounds = {"cpu_s": (cpu_s, 1, 600), "memory_mb": (memory_mb, 32, 65536), "processes": (processes, 1, 4096)}
    bounds |= {"open_files": (open_files, 16, 4096), "file_mb": (file_mb, 0, 65536), "disk_mb": (disk_mb, 1, 65536)}
    bounds |= {"output_kb": (output_kb, 1, 1 << 20)}
    for name, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise ValueError(f"{name} must be within [{low}, {high}], got {value}")
    if not 0 < wall_s <= 3600 or not 0 < test_timeout_s <= 3600:
        raise ValueError("wall_s and test_timeout_s must be in (0, 3600] seconds")
    tests = read_tests(sample.metadata.get(tests_field))
    limits = SandboxLimits(cpu_s, wall_s, memory_mb, processes, open_files, file_mb, disk_mb, output_kb, test_timeout_s)
    run = run_program(program_of(sample), tests, limits, require=required, python=python or sys.executable)
    score = run.passed / len(tests)
    if all_or_nothing:
        score = float(run.passed == len(tests))
    detail: dict[str, Any] = {
        "tests": list(run.verdicts),
        "passed": run.passed,
        "failure": None if run.failure is None else run.failure.value,
        "isolation": run.isolation.name.lower(),
    }
    if run.message:
        detail["message"] = run.message
    errors = {str(n): m for n, m in enumerate(run.messages) if m}
    if errors:
        detail["errors"] = dict(list(errors.items())[:8])
    return Verdict(score, detail)
