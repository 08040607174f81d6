"""bench/judge.py: a short run grades through a judge at each cap, against transformers serve and two loopback
judges, never past the cap. No rate is asserted: the numbers are the benchmark's to report."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from bench import judge as bench


@pytest.mark.e2e
def test_a_short_run_judges_every_completion_within_the_cap(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)
    bench.main(["--caps", "1", "3", "--completions", "6", "--max-tokens", "8", "--loopback-completions", "9"])
    rows = saved["judge"]["rows"]
    assert [(r["judge"].split(",")[0], r["cap"], r["completions"]) for r in rows] == [
        ("transformers serve", 1, 6),
        ("transformers serve", 3, 6),
        ("loopback judge", 1, 9),
        ("loopback judge", 3, 9),
        ("instant loopback judge", 1, 9),
        ("instant loopback judge", 3, 9),
    ]
    for r in rows:
        assert r["requests"] == r["completions"]  # one request a completion: none failed and was tried again
        assert r["scored"] + r["no_score"] == r["completions"] and r["other_failures"] == 0
        if r["judge"].startswith("instant"):  # it may answer each request before the next one comes
            assert r["max_in_flight"] <= r["cap"] and r["scored"] == r["completions"]
        else:  # the others keep every request a while: the cap fills, and holds
            assert r["max_in_flight"] == r["cap"]
    table = [
        line for line in capsys.readouterr().out.splitlines() if re.match(r"\| (transformers|loopback|instant)", line)
    ]
    assert len(table) == 6
