"""Tests for the ``reasoning_gym`` grader in :mod:`proctor.server.grading.builtin`, entry by entry for every
dataset the shipped reasoning ladder uses."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym as rg
import yaml

from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import BUILTIN_GRADERS, reasoning_gym
from proctor.server.shipped import builtin_path
from proctor.server.sources.base import Record, SampleId
from proctor.server.sources.registry import build_source
from proctor.server.spec import ReasoningGymSourceSpec, parse_spec

ENTRIES = 40


def ladder() -> dict[str, ReasoningGymSourceSpec]:
    path = builtin_path("reasoning_ladder")
    spec = parse_spec(yaml.safe_load(path.read_text()), file=str(path))
    return {name: src for name, src in spec.sources.items() if isinstance(src, ReasoningGymSourceSpec)}


def records(spec: ReasoningGymSourceSpec, n: int = ENTRIES) -> list[Record]:
    src = build_source("rg", spec, base_dir=Path("."), seed=7)
    return [src.record(k) for k in range(n)]


def graded(record: Record, completion: str) -> float:
    """The grader's score for ``completion``, with the record's metadata as it arrives: through JSON."""
    metadata = json.loads(json.dumps(record.metadata))
    return reasoning_gym(
        GradeInput(prompt=record.prompt, completion=completion, answer=record.answer, metadata=metadata)
    )


def answered(text: str) -> str:
    return f"<think>Let me work it out.</think>\n<answer>{text}</answer>"


# --- per entry: right answers score 1, wrong ones less ----------------------------------------------------


def _number_variants(record: Record) -> tuple[list[str], list[str]]:
    assert record.answer is not None
    value = Decimal(record.answer)
    return [record.answer], [str(value + 1), str(-value - 1), f"{record.answer}.5"]


def _chain_sum_variants(record: Record) -> tuple[list[str], list[str]]:
    right, wrong = _number_variants(record)
    value = Decimal(right[0])
    # chain_sum's scorer takes signs, leading zeros and trailing decimals: "+012.0" is 12.
    return [*right, f"{'-' if value < 0 else '+'}0{abs(value)}.0"], wrong


def _knights_variants(record: Record) -> tuple[list[str], list[str]]:
    names, solution, terms = (record.metadata[k] for k in ("names", "solution", "knight_knave_terms"))

    def say(roles: list[bool], order: list[int]) -> str:
        clauses = [f"{names[i]} is a {terms['knight'] if roles[i] else terms['knave']}" for i in order]
        return ", ".join(clauses[:-1]) + f", and {clauses[-1]}"

    everyone = list(range(len(names)))
    flipped = [not solution[0], *solution[1:]]
    return [record.answer or "", say(solution, everyone[::-1])], [say(flipped, everyone)]


def _countdown_variants(record: Record) -> tuple[list[str], list[str]]:
    assert record.answer is not None
    numbers, target = record.metadata["numbers"], record.metadata["target"]
    wrong = [f"({record.answer}) * 2"]  # uses a number it was not given
    if sum(numbers) != target:
        wrong.append(" + ".join(map(str, numbers)))  # the right numbers, the wrong value
    return [record.answer, record.answer.replace(" ", "")], wrong


VARIANTS: dict[str, Callable[[Record], tuple[list[str], list[str]]]] = {
    "chain_sum": _chain_sum_variants,
    "basic_arithmetic": _number_variants,
    "knights_knaves": _knights_variants,
    "countdown": _countdown_variants,
}


def test_every_ladder_dataset_has_per_entry_cases() -> None:
    assert {spec.dataset for spec in ladder().values()} == set(VARIANTS)


@pytest.mark.parametrize("source", sorted(ladder()))
def test_right_answers_score_one_and_wrong_ones_less_for_every_entry(source: str) -> None:
    spec = ladder()[source]
    for record in records(spec):
        right, wrong = VARIANTS[spec.dataset](record)
        for text in right:
            assert graded(record, answered(text)) == 1.0, (record.key, record.prompt, text)
        for text in wrong:
            assert graded(record, answered(text)) < 1.0, (record.key, record.prompt, text)


def test_knights_and_knaves_gives_partial_credit_per_person_right() -> None:
    spec = ladder()["knights_3"]
    for record in records(spec, 10):
        _, [one_wrong] = _knights_variants(record)
        assert graded(record, answered(one_wrong)) == pytest.approx(0.3 + 0.7 * 2 / 3)


@pytest.mark.parametrize("source", sorted(ladder()))
def test_the_score_is_the_datasets_own(source: str) -> None:
    spec = ladder()[source]
    dataset = rg.create_dataset(spec.dataset, **spec.config)
    for record in records(spec, 10):
        entry = {"question": record.prompt, "answer": record.answer, "metadata": record.metadata}
        for text in ["", "0", f"{record.answer}1", record.answer or ""]:
            assert graded(record, answered(text)) == dataset.score_answer(text, entry)


def test_the_scorer_is_configured_as_the_source_is() -> None:
    # decimal_arithmetic accepts answers within one unit of its config's last decimal place (default: 3 places).
    spec = ReasoningGymSourceSpec.model_validate(
        {
            "kind": "reasoning_gym",
            "dataset": "decimal_arithmetic",
            "config": {"min_num_decimal_places": 1, "max_num_decimal_places": 1},
            "graders": ["reasoning_gym"],
        }
    )
    record = records(spec, 1)[0]
    assert record.answer is not None
    near = str(Decimal(record.answer) + Decimal("0.05"))
    assert graded(record, answered(near)) == 1.0
    defaults = {k: v for k, v in record.metadata.items() if k != "reasoning_gym"}
    assert graded(Record(0, record.prompt, record.answer, metadata=defaults), answered(near)) == 0.0


# --- reading the answer -----------------------------------------------------------------------------------


def sums() -> Record:
    return records(ladder()["sums_short"], 1)[0]


def test_an_answer_outside_the_tags_is_no_answer() -> None:
    record = sums()
    assert record.answer is not None
    assert graded(record, record.answer) == 0.0
    assert graded(record, f"<think>x</think>The answer is {record.answer}.") == 0.0


def test_the_last_answer_tags_count() -> None:
    record = sums()
    assert graded(record, f"<answer>{record.answer}1</answer> no, <answer> {record.answer} </answer>") == 1.0
    assert graded(record, f"<answer>{record.answer}</answer> no, <answer>{record.answer}1</answer>") < 1.0


def test_tags_inside_the_reasoning_are_not_the_answer() -> None:
    record = sums()
    assert graded(record, f"<think><answer>{record.answer}</answer></think>") == 0.0
    assert graded(record, f"<think><answer>{record.answer}1</answer></think><answer>{record.answer}</answer>") == 1.0


def test_countdown_without_an_answer_gets_its_scorers_floor() -> None:
    # countdown's scorer gives 0.01 for no answer at all, as in reasoning-gym's own evaluation.
    record = records(ladder()["countdown"], 1)[0]
    assert graded(record, "I give up") == 0.01


# --- records from elsewhere -------------------------------------------------------------------------------


def entry_of(record: Record) -> dict[str, Any]:
    metadata = {k: v for k, v in json.loads(json.dumps(record.metadata)).items() if k != "reasoning_gym"}
    return {"question": record.prompt, "answer": record.answer, "metadata": metadata}


def test_metadata_naming_only_the_dataset_scores_with_its_defaults() -> None:
    # A file of reasoning-gym entries whose metadata fields were kept as they are.
    record = sums()
    entry = entry_of(record)
    sample = GradeInput(entry["question"], answered(entry["answer"]), entry["answer"], entry["metadata"])
    assert reasoning_gym(sample) == 1.0


def test_a_file_of_entries_with_their_metadata_object() -> None:
    # A JSONL dump of entries: question, answer and a `metadata` object, which becomes one metadata field.
    record = sums()
    entry = entry_of(record)
    sample = GradeInput(entry["question"], answered(entry["answer"]), entry["answer"], {"metadata": entry["metadata"]})
    assert reasoning_gym(sample) == 1.0


def test_a_record_of_no_dataset_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        reasoning_gym(GradeInput("Q?", "<answer>4</answer>", "4", {"topic": "sums"}))
    assert str(info.value) == (
        "reasoning_gym grades records of reasoning-gym datasets, and this record's metadata names none "
        "(no source_dataset): use it on reasoning_gym sources, or on files of reasoning-gym entries that keep "
        "their metadata"
    )


def test_an_unknown_dataset_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        reasoning_gym(GradeInput("Q?", "<answer>4</answer>", "4", {"source_dataset": "chain_sums"}))
    assert str(info.value) == (
        "reasoning_gym: the record names the dataset 'chain_sums', which this reasoning-gym does not have; "
        "install the reasoning-gym version the records were made with"
    )


def test_without_reasoning_gym_the_grader_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    # A dataset no earlier test scored, so no scorer is cached for it.
    with pytest.raises(ImportError) as info:
        reasoning_gym(GradeInput("Q?", "<answer>4</answer>", "4", {"source_dataset": "not_cached_anywhere"}))
    assert str(info.value).startswith("the reasoning_gym grader needs reasoning-gym, which cannot be imported (")
    assert str(info.value).endswith("): pip install 'proctor[reasoning-gym]'")


def test_it_is_a_builtin_grader() -> None:
    assert BUILTIN_GRADERS["reasoning_gym"] is reasoning_gym


# --- through the server -----------------------------------------------------------------------------------


def grade_item(sample: dict[str, Any], index: int, completion: str) -> dict[str, Any]:
    return {
        "sample_id": sample["sample_id"],
        "slot": sample["slot"],
        "completion_index": index,
        "completion": completion,
    }


@pytest.mark.anyio
async def test_the_server_grades_the_ladder_in_its_grader_processes(open_client: Callable[..., Any]) -> None:
    path = builtin_path("reasoning_ladder")
    src = load_curriculum(path).sources["sums_short"]  # the first stage's only source
    async with open_client(curriculum=path, grader_timeout_s=30.0) as client:
        sampled = (await client.post("/sample", json={"iteration": 0, "batch_size": 4})).json()
        items = []
        for sample in sampled["samples"]:
            record = src.record(SampleId.parse(sample["sample_id"]).key)
            assert (sample["prompt"], sample["metadata"]) == (record.prompt, record.metadata)
            assert "<answer></answer>" in sample["system_prompt"]
            items += [
                grade_item(sample, 0, answered(record.answer or "")),
                grade_item(sample, 1, f"The answer is {record.answer}."),
            ]
        results = (await client.post("/grade", json={"iteration": 0, "items": items})).json()["results"]
    assert len(results) == 8
    assert {(r["completion_index"], r["reward"], r["error"]) for r in results} == {(0, 1.0, None), (1, 0.0, None)}
