"""Tests for the curricula shipped in :mod:`proctor.curricula`: they load, and their answers grade as correct."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from proctor.curricula import builtin_curricula, builtin_path
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.compose import weighted_reward
from proctor.server.grading.registry import SourceGraders, load_callable
from proctor.server.sources.base import Record

SHIPPED = builtin_curricula()
RECORDS_CHECKED = 20


def load(name: str) -> Curriculum:
    return load_curriculum(SHIPPED[name])


def test_the_documented_curricula_ship() -> None:
    assert {"arithmetic", "word_problems"} <= set(SHIPPED)
    for name, path in SHIPPED.items():
        assert path.suffix == ".yaml"
        assert path.is_file()
        assert builtin_path(name) == path
    assert builtin_path() == SHIPPED["arithmetic"]


def test_unknown_builtin_curriculum() -> None:
    with pytest.raises(FileNotFoundError, match=r"no shipped curriculum named 'nope'; shipped: .*arithmetic"):
        builtin_path("nope")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_loads(name: str) -> None:
    cur = load(name)
    assert cur.name == name == Path(SHIPPED[name]).stem
    assert cur.stages
    assert set(cur.graders) == set(cur.sources)
    assert load(name).hash == cur.hash


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_stage_mix_has_positive_weights(name: str) -> None:
    cur = load(name)
    for stage in cur.spec.stages:
        assert stage.mix
        assert all(entry.weight > 0 for entry in stage.mix), stage.name
    for stage in cur.stages:
        assert all(w > 0 for _, w in stage.mix), stage.name
        assert math.fsum(w for _, w in stage.mix) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_source_is_served_by_some_stage(name: str) -> None:
    cur = load(name)
    assert {source for stage in cur.stages for source, _ in stage.mix} == set(cur.sources)


def reward(graders: SourceGraders, record: Record, completion: str) -> float:
    """What grading ``completion`` against ``record`` gives, calling the source's local graders directly."""
    sample = GradeInput(prompt=record.prompt, completion=completion, answer=record.answer, metadata=record.metadata)
    scores = {g.key: load_callable(g.ref)(sample, **g.params) for g in graders.local}
    return weighted_reward(graders, scores)


def _graded_sources() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name in sorted(SHIPPED):
        try:
            sources = list(load(name).sources)
        except Exception:  # collected anyway: the test itself then fails with the load error
            sources = ["<does-not-load>"]
        out += [(name, source) for source in sources]
    return out


@pytest.mark.parametrize(("curriculum", "source"), _graded_sources(), ids=str)
def test_reference_answers_grade_as_exactly_one(curriculum: str, source: str) -> None:
    cur = load(curriculum)
    src = cur.sources[source]
    graders = cur.graders[source]
    assert graders.local, "every shipped grader runs locally"
    count = RECORDS_CHECKED if src.size is None else min(RECORDS_CHECKED, src.size)
    for key in range(count):
        record = src.record(key)
        assert record.answer is not None

        assert reward(graders, record, f"<think>reasoning</think>{record.answer}") == 1.0, (
            key,
            record.prompt,
            record.answer,
        )
        # ... and a wrong answer does not (so the check above can fail).
        assert reward(graders, record, f"<think>reasoning</think>{record.answer}1") < 1.0, (key, record.prompt)
