"""bench/curriculum_sim.py: its quick mode end to end (simulated learning and real servers), and its tables."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import curriculum_sim as bench


def _table(text: str, head: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header starts with ``head``, header and rule left out."""
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(f"| {head}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.e2e
def test_the_quick_run_prints_every_table(
    saved_results: Callable[[ModuleType], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = saved_results(bench)

    bench.main(["--quick"])

    out = capsys.readouterr().out
    for learner in bench.LEARNERS:
        learning = _table(out, f"curriculum ({learner.name} learner) |")
        assert [row[0] for row in learning] == [*(v.name for v in bench.VARIANTS), bench.ORACLE]
        assert all(len(row) == 8 for row in learning)
        assert learning[0][5] in ("1.00×", "-")  # uniform against itself (or no base when it never got there)
        # Without refill, the batch trained on is the batch drawn: the same zero-variance share.
        refilled = {v.name for v in bench.VARIANTS if v.refill is not None}
        assert all(row[3] == row[4] for row in learning if row[0] not in refilled)
    lags = _table(out, f"{saved['curriculum_sim']['learning']['best']['per source']}: statistics lag")
    assert [row[0] for row in lags] == ["0", "1", "2"]
    costs = _table(out, "sampler (batch 32) | records")
    assert [(row[0], row[1]) for row in costs] == [
        (name, n) for name, _ in bench.LATENCY_SAMPLERS[1:] for n in ("10,000", "100,000")
    ]
    latency = _table(out, "sampler (100,000 records, batch 32)")
    assert [row[0] for row in latency] == [name for name, _ in bench.LATENCY_SAMPLERS]
    assert all(re.fullmatch(r"\d+\.\d", cell) for row in latency for cell in row[1:5])
    assert len(re.findall(r"^goal: .*: (met|missed|not measurable)", out, flags=re.MULTILINE)) == 5

    result = saved["curriculum_sim"]
    assert result["seeds"] == 1 and result["steps"] == 60
    assert {r["variant"] for r in result["learning"]["runs"]} == {v.name for v in bench.VARIANTS} | {bench.ORACLE}
    assert {r["learner"] for r in result["learning"]["runs"]} == {learner.name for learner in bench.LEARNERS}
    assert all(r["iterations"] == 30 for r in result["latency"])


def test_the_staged_curriculum_is_a_gated_ladder_over_the_sources() -> None:
    [staged] = [v for v in bench.VARIANTS if v.sampler is None]
    text = bench.curriculum_yaml(staged, 600, seed=2)
    assert text.count("advance: {threshold: 0.8") == bench.SOURCES - 1
    assert text.count("replay: 0.1") == bench.SOURCES - 1
    assert "sampler" not in text


def test_the_learning_progress_curricula_set_their_weights_by_learning_progress() -> None:
    mixed = [v for v in bench.VARIANTS if v.mixing is not None]
    assert [v.name for v in mixed] == [
        "learning_progress",
        "learning_progress + skip_zero_variance",
        "learning_progress + refill",
    ]
    for variant in mixed:
        text = bench.curriculum_yaml(variant, 600, seed=2)
        assert "mixing: {kind: learning_progress}" in text and "advance" not in text


def test_the_refill_curricula_replace_zero_variance_groups(tmp_path: Path) -> None:
    refilled = {v.name: v for v in bench.VARIANTS if v.refill is not None}
    assert sorted(refilled) == ["learning_progress + refill", "refill"]
    for variant in refilled.values():
        text = bench.curriculum_yaml(variant, 600, seed=2)
        assert "refill: {kind: zero_variance}" in text and "sampler: {kind: uniform}" in text
    assert "mixing" not in bench.curriculum_yaml(refilled["refill"], 600, seed=2)
    # The rule as loaded: the spec's default rounds; the other curricula have none.
    bench.write_population(tmp_path, seed=0)
    [stage] = bench._load(tmp_path, refilled["learning_progress + refill"], 600, seed=0).stages
    assert stage.refill is not None and (stage.refill.kind, stage.refill.max_rounds) == ("zero_variance", 4)
    [plain] = bench._load(tmp_path, bench.VARIANTS[0], 600, seed=0).stages
    assert plain.refill is None
