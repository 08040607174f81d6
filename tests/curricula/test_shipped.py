"""Tests for the curricula shipped in :mod:`proctor.curricula`: they load, and their answers grade as correct."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.grading.base import GradeInput, Verdict
from proctor.server.grading.compose import weighted_reward
from proctor.server.grading.registry import SourceGraders, load_callable
from proctor.server.shipped import builtin_curricula, builtin_path
from proctor.server.sources.base import Record, Source

SHIPPED = builtin_curricula()
RECORDS_CHECKED = 20


def load(name: str) -> Curriculum:
    return load_curriculum(SHIPPED[name])


def test_the_documented_curricula_ship() -> None:
    assert {"arithmetic", "word_problems", "reasoning_ladder"} <= set(SHIPPED)
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
    for loaded in cur.stages:
        assert all(w > 0 for _, w in loaded.mix), loaded.name
        assert math.fsum(w for _, w in loaded.mix) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_source_is_served_by_some_stage(name: str) -> None:
    cur = load(name)
    assert {source for stage in cur.stages for source, _ in stage.mix} == set(cur.sources)


def reward(graders: SourceGraders, record: Record, completion: str) -> float:
    """What grading ``completion`` against ``record`` gives, calling the source's local graders directly."""
    sample = GradeInput(prompt=record.prompt, completion=completion, answer=record.answer, metadata=record.metadata)
    results = {g.key: load_callable(g.ref)(sample, **g.params) for g in graders.local}
    return weighted_reward(graders, {k: r.score if isinstance(r, Verdict) else r for k, r in results.items()})


def _graded_sources() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for name in sorted(SHIPPED):
        try:
            sources = list(load(name).sources)
        except Exception:  # collected anyway: the test itself then fails with the load error
            sources = ["<does-not-load>"]
        out += [(name, source) for source in sources]
    return out


def reads_answer_tags(graders: SourceGraders) -> bool:
    """Whether the source is graded by reasoning-gym's scorers, which read only the text inside <answer></answer>."""
    return any(g.ref == "builtin:reasoning_gym" for g in graders.local)


def answered(graders: SourceGraders, answer: str) -> str:
    """A completion that gives ``answer`` where the source's graders look for it."""
    if reads_answer_tags(graders):
        return f"<think>reasoning</think><answer>{answer}</answer>"
    return f"<think>reasoning</think>{answer}"


def runs_code(graders: SourceGraders) -> bool:
    return any(g.ref == "builtin:code" for g in graders.local)


def wrong_answer(src: Source, graders: SourceGraders, record: Record) -> str:
    if runs_code(graders):
        return "```python\nprint('no')\n```"  # defines nothing the tests call, prints what no test expects
    if not reads_answer_tags(graders):
        return f"{record.answer}1"
    assert src.size is not None, "reasoning-gym sources are finite"
    # reasoning-gym's scorers forgive what is not the answer proper ("… is a knave.1" still names the knaves);
    # the next record's answer, where it differs, is wrong in every dataset's terms.
    for step in range(1, src.size):
        other = src.record((record.key + step) % src.size).answer
        if other is not None and other != record.answer:
            return other
    raise AssertionError(f"every record of the source has the answer {record.answer!r}")


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

        assert reward(graders, record, answered(graders, record.answer)) == 1.0, (
            key,
            record.prompt,
            record.answer,
        )
        # ... and a wrong answer does not (so the check above can fail).
        wrong = wrong_answer(src, graders, record)
        assert reward(graders, record, answered(graders, wrong)) < 1.0, (key, record.prompt, wrong)


def test_the_reasoning_ladder_asks_for_the_answer_tags_its_grader_reads() -> None:
    cur = load("reasoning_ladder")
    assert all(reads_answer_tags(graders) for graders in cur.graders.values())
    assert cur.system_prompt is not None and "<answer></answer>" in cur.system_prompt


_WITHOUT_REASONING_GYM = textwrap.dedent(
    """
    import json, sys
    import yaml
    from proctor.server.shipped import builtin_path
    from proctor.server.curriculum.loader import load_curriculum
    from proctor.server.spec import CurriculumError, parse_spec

    # Curricula without a reasoning_gym source never import it, installed or not.
    for name in ("arithmetic", "word_problems"):
        load_curriculum(builtin_path(name))
    assert not [m for m in sys.modules if m.split(".")[0] == "reasoning_gym"], "reasoning_gym was imported"

    sys.modules["reasoning_gym"] = None  # as if the extra were not installed
    for name in ("arithmetic", "word_problems"):
        load_curriculum(builtin_path(name))
    path = builtin_path("reasoning_ladder")
    spec = parse_spec(yaml.safe_load(path.read_text()), file=str(path))
    try:
        load_curriculum(path)
    except CurriculumError as exc:
        print(json.dumps({"sources": list(spec.sources), "problems": exc.problems}))
    else:
        raise SystemExit("reasoning_ladder loaded without reasoning_gym")
    """
)


def test_shipped_curricula_validate_without_the_reasoning_gym_extra() -> None:
    run = subprocess.run([sys.executable, "-c", _WITHOUT_REASONING_GYM], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["sources"]) >= 3  # parse_spec accepted the ladder: only building its sources needs the extra
    assert [path for path, _ in out["problems"]] == [f"sources.{name}.kind" for name in out["sources"]]
    for _, message in out["problems"]:
        assert message.startswith("the reasoning_gym source kind needs reasoning-gym, which cannot be imported (")
        assert message.endswith("): pip install 'proctor[reasoning-gym]'")
