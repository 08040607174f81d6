"""bench/regrade.py: a short run stores completions through /grade, regrades every one, and no verdict changes
(the same graders). No rate is asserted: the numbers are the benchmark's to report."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from bench import regrade as bench


@pytest.mark.e2e
def test_a_short_run_regrades_every_stored_completion(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)
    bench.main(["--completions", "1500"])
    result = saved["regrade"]
    assert (result["completions"], result["regraded"], result["changed"]) == (1500, 1500, 0)
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1,500 |")]
    assert row.endswith("| 0 |")
