"""bench/sandbox.py: a short run measures its three rows, every sandboxed run passing its tests. No rate is asserted:
the numbers are the benchmark's to report."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from bench import sandbox as bench
from proctor.server.grading.sandbox import Isolation, available_isolation


@pytest.mark.e2e
@pytest.mark.skipif(available_isolation() < Isolation.NAMESPACES, reason="the sandbox's namespaces need root")
def test_a_short_run_measures_each_row(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)
    bench.main(["--seconds", "1"])
    rows = saved["sandbox"]["rows"]
    assert [r["name"] for r in rows] == [
        "a bare process (python -I -c)",
        "the sandbox (run_program)",
        "through /grade (2 grader processes)",
    ]
    assert all(r["requests"] > 0 for r in rows)
    assert "| the sandbox (run_program) |" in capsys.readouterr().out
