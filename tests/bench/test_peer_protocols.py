"""bench/peer_protocols.py: a short run drives every route against a real server, each with answers. No figure
is asserted: the numbers are the benchmark's to report."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from bench import peer_protocols as bench


@pytest.mark.e2e
def test_a_short_run_measures_every_route(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)
    bench.main(["--seconds", "0.3"])
    rows = saved["peer_protocols"]["rows"]
    assert [r["name"].split(" ")[0] for r in rows] == [
        "/grade",
        "/score",
        "/openrlhf/reward",
        "/slime/reward",
        "/score",
    ]
    assert all(r["requests"] > 0 for r in rows)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| /")]
    assert len(table) == 5 and all(
        re.fullmatch(r"\| .+ \| [\d,]+ \| [\d,]+ \| \d+\.\d \| \d+\.\d \|", t) for t in table
    )
