"""bench/trainer_overhead.py: a short run trains every variant (local, a bare server's reward, proctor through
/grade and through the store) for its steps, and prints what each adds. No time is asserted: the numbers are the
benchmark's to report."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from bench import trainer_overhead as bench


@pytest.mark.e2e
def test_a_short_run_trains_every_variant(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)
    bench.main(["--steps", str(bench.WARMUP + 3), "--rounds", "1"])
    runs = saved["trainer_overhead"]["runs"]
    assert [r["variant"] for r in runs] == [
        "in-memory Dataset + local reward",
        "in-memory Dataset + a reward posted to a bare server (bench.bare_baseline)",
        "RemoteRLDataset + remote_reward through /grade",
        "RemoteRLDataset + remote_reward through the store",
    ]
    # Every step after the warm-up is timed, and so is every reward call.
    assert all(len(r["step_ms"]) == 3 and len(r["reward_ms"]) == 3 for r in runs)
    added = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| **added by")]
    assert [line.split("**")[1] for line in added] == [
        "added by a reward over HTTP, to a bare server",
        "added by the dataserver, through /grade",
        "added by the dataserver, through the store",
    ]


def test_a_run_too_short_to_time_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--steps", str(bench.WARMUP)])
    assert f"--steps must be more than {bench.WARMUP}" in capsys.readouterr().err
