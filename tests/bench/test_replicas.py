"""bench/replicas.py: the loads run against one server, one behind nginx, two behind nginx, two on one port
(--workers 2) and two that share nothing, and the failover load counts its requests around a SIGKILL. No figure is asserted: the numbers are the
benchmark's to report."""

from __future__ import annotations

import re

import pytest

from bench import replicas


@pytest.mark.e2e
def test_a_short_run_measures_every_arrangement_and_a_failover() -> None:
    results = replicas.run(seconds=0.5, failover_seconds=3.0)
    for side in ("direct", "balanced_1", "balanced_2", "workers_2"):
        assert all(results[side][key]["requests"] > 0 for key in ("sample", "grade")), side
    assert len(results["apart_2"]) == 2
    assert all(r[key]["requests"] > 0 for r in results["apart_2"] for key in ("sample", "grade"))
    failover = results["failover"]
    assert failover["served_before_kill"] > 0
    assert failover["requests"] > failover["served_before_kill"] + failover["failed"]  # served again after it
    lines = replicas.table(results).splitlines()
    assert lines[2].startswith("| /sample new iteration (batch 16) |")
    assert lines[3].startswith("| /grade (64 completions) |")
    assert all(len(re.findall(r"\| \d+\.\d\d× \|", line)) == 3 for line in lines[2:4]), lines
    assert lines[-1].startswith("| seconds from the kill to the last failure |")
