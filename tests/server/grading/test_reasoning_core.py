"""Tests for the ``reasoning_core`` grader in :mod:`proctor.server.grading.builtin`, and for the curriculum of
reasoning-core sources that the curricula page shows, served and graded through the app."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import reasoning_core as rc

from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import BUILTIN_GRADERS, reasoning_core
from proctor.server.sources.base import Record, SampleId
from proctor.server.sources.registry import build_source
from proctor.server.spec import ReasoningCoreSourceSpec

DOCS = Path(__file__).resolve().parents[3] / "docs" / "curricula.md"


def records(task: str = "arithmetics", n: int = 1, level: int = 0) -> list[Record]:
    spec = ReasoningCoreSourceSpec.model_validate(
        {"kind": "reasoning_core", "task": task, "level": level, "size": 100, "graders": ["reasoning_core"]}
    )
    src = build_source("rc", spec, base_dir=Path("."), seed=7)
    return [src.record(k) for k in range(n)]


def graded(record: Record, completion: str) -> float:
    """The grader's score for ``completion``, with the record's metadata as it arrives: through JSON."""
    metadata = json.loads(json.dumps(record.metadata))
    return reasoning_core(
        GradeInput(prompt=record.prompt, completion=completion, answer=record.answer, metadata=metadata)
    )


def answered(text: str | None) -> str:
    return f"<think>Let me work it out.</think>\n<answer>{text}</answer>"


def row_metadata(record: Record) -> dict[str, Any]:
    """The item's metadata as reasoning-core made it: the record's, without what proctor adds."""
    return {k: v for k, v in json.loads(json.dumps(record.metadata)).items() if k != "reasoning_core"}


def sums() -> Record:
    return records()[0]


# --- reading the answer -----------------------------------------------------------------------------------


def test_an_answer_outside_the_tags_is_no_answer() -> None:
    record = sums()
    assert graded(record, answered(record.answer)) == 1.0
    assert graded(record, record.answer or "") == 0.0
    assert graded(record, f"<think>x</think>The answer is {record.answer}.") == 0.0


def test_the_last_answer_tags_count_stripped() -> None:
    record = sums()
    assert graded(record, f"<answer>{record.answer}1</answer> no, <answer>\n {record.answer} \n</answer>") == 1.0
    assert graded(record, f"<answer>{record.answer}</answer> no, <answer>{record.answer}1</answer>") < 1.0


def test_tags_inside_the_reasoning_are_not_the_answer() -> None:
    record = sums()
    assert graded(record, f"<think><answer>{record.answer}</answer></think>") == 0.0
    assert graded(record, f"<think><answer>{record.answer}1</answer></think><answer>{record.answer}</answer>") == 1.0


# --- the task's own scorer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["arithmetics", "logic_qa", "string_transduction", "table_statistics"])
def test_the_score_is_the_tasks_own(task: str) -> None:
    made = records(task, 5, level=1)
    for record in made:
        row = {"prompt": record.prompt, "answer": record.answer, "metadata": row_metadata(record)}
        for text in ["", "0", f"{record.answer}1", *(r.answer or "" for r in made)]:
            # reasoning-core's own dispatcher, which finds the task in the row's metadata.
            assert graded(record, answered(text)) == float(rc.score_answer(text, row)), (task, text)


def test_partial_credit_is_the_tasks() -> None:
    # string_transduction gives credit for the characters an answer gets right.
    made = records("string_transduction", 10)
    scores = [graded(record, answered(other.answer)) for record in made for other in made if other is not record]
    assert any(0 < s < 1 for s in scores)


# --- records from elsewhere -------------------------------------------------------------------------------


def test_a_file_of_rows_with_the_items_metadata_as_fields() -> None:
    # A JSONL file of reasoning-core rows whose metadata was kept field by field.
    record = sums()
    metadata = row_metadata(record)
    assert reasoning_core(GradeInput(record.prompt, answered(record.answer), record.answer, metadata)) == 1.0


def test_a_file_of_rows_with_the_items_metadata_as_json_text() -> None:
    # reasoning-core's published rows: prompt, answer, task and the metadata as JSON text, one field of the record.
    record = sums()
    fields = {"metadata": json.dumps(row_metadata(record)), "task": "arithmetics"}
    assert reasoning_core(GradeInput(record.prompt, answered(record.answer), record.answer, fields)) == 1.0
    assert reasoning_core(GradeInput(record.prompt, answered("no"), record.answer, fields)) == 0.0


def test_a_record_of_no_task_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        reasoning_core(GradeInput("Q?", "<answer>4</answer>", "4", {"topic": "sums"}))
    assert str(info.value) == (
        "reasoning_core grades records of reasoning-core tasks, and this record's metadata names none "
        "(no _task): use it on reasoning_core sources, or on files of reasoning-core rows that keep their metadata"
    )


def test_an_unknown_task_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        reasoning_core(GradeInput("Q?", "<answer>4</answer>", "4", {"_task": "arithmetic"}))
    assert str(info.value) == (
        "reasoning_core: the record names the task 'arithmetic', which this reasoning-core does not have; "
        "install the reasoning-core version the records were made with"
    )


def test_without_reasoning_core_the_grader_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_core", None)
    # A task no earlier test scored, so no scorer is cached for it.
    with pytest.raises(ImportError) as info:
        reasoning_core(GradeInput("Q?", "<answer>4</answer>", "4", {"_task": "not_cached_anywhere"}))
    assert str(info.value).startswith("the reasoning_core grader needs reasoning-core, which cannot be imported (")
    assert str(info.value).endswith("): pip install 'proctor[reasoning-core]'")


def test_it_is_a_builtin_grader() -> None:
    assert BUILTIN_GRADERS["reasoning_core"] is reasoning_core


# --- the curricula page's example, through the server ------------------------------------------------------


def docs_curriculum(tmp_path: Path) -> Path:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [block] = [b for b in blocks if "kind: reasoning_core" in b]
    path = tmp_path / "reasoning_core.yaml"
    path.write_text(block)
    return path


def grade_item(sample: dict[str, Any], index: int, completion: str) -> dict[str, Any]:
    return {
        "sample_id": sample["sample_id"],
        "slot": sample["slot"],
        "completion_index": index,
        "completion": completion,
    }


def test_the_examples_sources_are_as_the_page_says(tmp_path: Path) -> None:
    cur = load_curriculum(docs_curriculum(tmp_path))
    difficulty = {name: src.source_difficulty() for name, src in cur.sources.items()}
    assert difficulty == {"logic_easy": 0.0, "logic_hard": 0.6, "sums": 0.4}
    assert cur.spec.stages[0].sampler.kind == "target_difficulty"


@pytest.mark.anyio
async def test_the_server_serves_and_grades_the_example(tmp_path: Path, open_client: Callable[..., Any]) -> None:
    path = docs_curriculum(tmp_path)
    sources = load_curriculum(path).sources
    async with open_client(curriculum=path, grader_timeout_s=60.0) as client:
        response = await client.post("/sample", json={"iteration": 0, "batch_size": 6})
        assert response.status_code == 200, response.text
        items = []
        for sample in response.json()["samples"]:
            sid = SampleId.parse(sample["sample_id"])
            record = sources[sid.source].record(sid.key)
            assert (sample["prompt"], sample["metadata"]) == (record.prompt, record.metadata)
            assert "<answer> and </answer>" in sample["system_prompt"]
            items += [
                grade_item(sample, 0, answered(record.answer)),
                grade_item(sample, 1, f"The answer is {record.answer}."),
            ]
        response = await client.post("/grade", json={"iteration": 0, "items": items})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
    assert len(results) == 12
    assert {(r["completion_index"], r["reward"], r["error"]) for r in results} == {(0, 1.0, None), (1, 0.0, None)}
