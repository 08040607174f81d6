"""bench/rollout_path.py and its bare baseline: both servers answer the same workload, and the table compares
them. No figure is asserted: the numbers are the benchmark's to report."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from bench import rollout_path
from bench.bare_baseline import create_app

ROWS = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 4 × 4?", "answer": "16"}]


def test_the_baseline_samples_and_grades_with_the_math_grader() -> None:
    with TestClient(create_app(ROWS)) as http:
        samples = http.post("/sample", json={"iteration": 0, "batch_size": 3}).json()["samples"]
        assert len(samples) == 3 and all(s["sample_id"] in ("rows:0", "rows:1") for s in samples)
        items = [
            {"sample_id": "rows:0", "completion": "<think>2 and 3</think>5"},
            {"sample_id": "rows:1", "completion": "<think>4 fours</think>15", "completion_index": 7},
        ]
        results = http.post("/grade", json={"items": items}).json()["results"]
    assert [(r["sample_id"], r["completion_index"], r["reward"]) for r in results] == [
        ("rows:0", 0, 1.0),
        ("rows:1", 7, 0.0),
    ]


@pytest.mark.e2e
def test_a_short_run_measures_both_servers_alike() -> None:
    results = rollout_path.run(seconds=0.5)
    for side in ("proctor", "baseline"):
        assert set(results[side]) == {"sample", "grade"}
        assert all(results[side][key]["requests"] > 0 for key in ("sample", "grade"))
        assert all(results[side][key]["cpu_ms"] > 0 for key in ("sample", "grade"))  # the server process's
    assert results["remote"]["requests"] > 0  # /grade with two grade-workers as the grader role
    lines = rollout_path.table(results).splitlines()
    assert lines[2].startswith("| /sample new iteration (batch 16) |")
    assert lines[3].startswith("| /grade (64 completions) |")
    assert set(results["postgresql"]) == {"sample", "grade"}  # the same loads, the state in PostgreSQL
    assert lines[7].startswith("| /sample new iteration (batch 16) |")
    assert lines[8].startswith("| /grade (64 completions) |")
    assert lines[13].startswith("| 2 `proctor grade-worker`s, 1 grader process each |")
    assert all(re.search(r"\| \d+\.\d\d× \|", line) for line in [*lines[2:4], *lines[7:9], *lines[12:14]]), lines
