"""``proctor export``: a real server's kept rollouts to parquet and JSON lines, read back with ``datasets``."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import httpx
import numpy as np
import pytest

from proctor.cli.main import main
from proctor.client import ExperienceClient

SLOTS, GROUP = 2, 2
ROWS = [(s, k) for s in range(SLOTS) for k in range(GROUP)]


def train_steps(url: str, steps: Sequence[int]) -> None:
    """What a trainer leaves in the store: sampled steps with completions, token ids and rewards."""
    with ExperienceClient(url) as experience:
        for step in steps:
            httpx.post(url + "/sample", json={"iteration": step, "batch_size": SLOTS}).raise_for_status()
            experience.open(step, slots=SLOTS, group_size=GROUP)
            answers = [r["answer"] for r in experience.read(step, ROWS, ["reference"])["reference"]]
            experience.put(
                step,
                ROWS,
                {
                    "completion": [str(a) if k == 0 else "wrong" for (_, k), a in zip(ROWS, answers, strict=True)],
                    "completion_tokens": [2] * len(ROWS),
                    "completion_ids": [np.array([step, s, k], np.int32) for s, k in ROWS],
                },
            )
        deadline = time.monotonic() + 60  # a liveness bound
        while not all(experience.all_consumed("grader", step) for step in steps):
            assert time.monotonic() < deadline, "the grader role did not grade the rows"
            time.sleep(0.02)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_export_writes_every_row_of_the_chosen_steps_with_its_columns(
    live_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    out = tmp_path / f"rollouts.{fmt}"
    with live_server() as url:
        train_steps(url, range(3))
        assert main(["export", str(out), "--server", url, "--iterations", "1:3", "--format", fmt]) == 0
    assert capsys.readouterr().out == f"wrote {2 * len(ROWS)} rows to {out}\n"

    rows = datasets.load_dataset("parquet" if fmt == "parquet" else "json", data_files=str(out), split="train")
    assert len(rows) == 2 * len(ROWS)
    assert {"prompt", "completion", "reward", "reward_detail", "stage", "sample_id"} <= set(rows.column_names)
    assert rows["iteration"] == [1] * len(ROWS) + [2] * len(ROWS)
    assert [(r["slot"], r["index"]) for r in rows] == ROWS * 2
    assert rows["reward"] == [1.0 if k == 0 else 0.0 for _, k in ROWS] * 2
    assert rows["stage"] == ["warm"] * (2 * len(ROWS))
    assert rows["completion_ids"] == [[i, s, k] for i in (1, 2) for s, k in ROWS]
    detail = rows["reward_detail"][0]
    assert (json.loads(detail) if fmt == "parquet" else detail) == {"components": {"numeric": 1.0}, "error": None}


def test_export_keeps_the_stages_and_sources_asked_for(live_server: Callable[..., Any], tmp_path: Path) -> None:
    everything, by_stage, by_source = (tmp_path / f"{name}.jsonl" for name in ("all", "stage", "source"))
    with live_server() as url:
        train_steps(url, [0, 1, 10, 11])  # stage warm (source add), then main (add and qa)
        assert main(["export", str(everything), "--server", url]) == 0
        assert main(["export", str(by_stage), "--server", url, "--stage", "main"]) == 0
        assert main(["export", str(by_source), "--server", url, "--source", "qa", "--source", "nope"]) == 0
    rows = [json.loads(line) for line in everything.read_text().splitlines()]
    assert {r["stage"] for r in rows} == {"warm", "main"}
    main_rows = [json.loads(line) for line in by_stage.read_text().splitlines()]
    assert main_rows == [r for r in rows if r["stage"] == "main"]
    qa_rows = [json.loads(line) for line in by_source.read_text().splitlines()]
    assert qa_rows == [r for r in rows if r["sample_id"].startswith("qa:")]
    assert qa_rows and {r["iteration"] for r in qa_rows} <= {10, 11}


def test_an_empty_export_is_a_parquet_file_with_the_schema(
    live_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "none.parquet"
    with live_server() as url:
        assert main(["export", str(out), "--server", url]) == 0
    assert capsys.readouterr().out == f"wrote 0 rows to {out}\n"
    rows = datasets.load_dataset("parquet", data_files=str(out), split="train", streaming=True)
    assert list(rows) == []
    assert rows.features is not None
    assert list(rows.features) == [
        "table", "iteration", "slot", "index", "attempt", "latest", "sample_id", "stage", "prompt", "reference",
        "completion", "completion_tokens", "completion_ids", "reward", "reward_detail",
    ]  # fmt: skip
    assert rows.features["reward"].dtype == "float64"
    assert rows.features["completion_tokens"].dtype == "int64"


def test_export_leaves_cells_not_yet_written_empty(live_server: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "partial.jsonl"
    with live_server(grader_workers=0) as url:  # nobody grades: no reward column yet
        with ExperienceClient(url) as experience:
            httpx.post(url + "/sample", json={"iteration": 0, "batch_size": SLOTS}).raise_for_status()
            experience.open(0, slots=SLOTS, group_size=GROUP)
            experience.put(0, ROWS[:1], {"completion": ["half done"], "completion_tokens": [None]})
        assert main(["export", str(out), "--server", url]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion"] for r in rows] == ["half done", None, None, None]
    assert all("reward" not in r for r in rows)


@pytest.mark.parametrize(
    ("iterations", "message"),
    [
        ("5", "--iterations '5': give START:STOP, e.g. 10:20 (STOP excluded), or : for all"),
        ("a:b", "--iterations 'a:b': START and STOP are whole numbers, e.g. 10:20"),
        ("9:3", "--iterations '9:3': need 0 ≤ START ≤ STOP"),
    ],
)
def test_export_refuses_a_bad_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], iterations: str, message: str
) -> None:
    assert main(["export", str(tmp_path / "x.jsonl"), "--iterations", iterations]) == 2
    assert capsys.readouterr().err == f"proctor export: {message}\n"


def test_export_without_a_server_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
        assert main(["export", str(tmp_path / "x.jsonl"), "--server", url]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"proctor export: the dataserver at {url} did not answer as asked: GET {url}/experience failed"
    )
