"""Tests for the procedural source in :mod:`proctor.server.sources.arithmetic`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.loader import load_curriculum
from proctor.server.shipped import builtin_path
from proctor.server.sources.arithmetic import ArithmeticSource
from proctor.server.sources.base import SampleId
from proctor.server.sources.registry import build_source
from proctor.server.spec import ArithmeticSourceSpec, CurriculumError, parse_spec

_TOKEN = re.compile(r"\d+|[-+*]")


def make(seed: int = 0, name: str = "a", **knobs: Any) -> ArithmeticSource:
    spec = ArithmeticSourceSpec.model_validate({"kind": "arithmetic", "graders": ["numeric"], **knobs})
    return ArithmeticSource(name, spec, seed)


def tokens(expression: str) -> tuple[list[int], list[str]]:
    parts = expression.split(" ")
    assert " ".join(parts) == expression
    assert all(_TOKEN.fullmatch(p) for p in parts), expression
    return [int(p) for p in parts[0::2]], parts[1::2]


@st.composite
def knobs(draw: st.DrawFn, allow_negative: bool | None = None) -> dict[str, Any]:
    lo = draw(st.integers(1, 6))
    hi = draw(st.integers(lo, 7))
    return {
        "ops": draw(st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True)),
        "digits": [lo, hi],
        "operands": draw(st.integers(2, 5)),
        "allow_negative": draw(st.booleans()) if allow_negative is None else allow_negative,
    }


SEEDS = st.integers(-(2**63), 2**63)
KEYS = st.integers(0, 2**62)


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, key=KEYS, k=knobs())
def test_record_is_a_pure_function_of_seed_knobs_and_key(seed: int, key: int, k: dict[str, Any]) -> None:
    assert make(seed, **k).record(key) == make(seed, **k).record(key)


def test_records_depend_on_seed_name_and_key() -> None:
    base = [make(1, "a", digits=[3, 3]).record(k).prompt for k in range(50)]
    assert len(set(base)) >= 45
    assert base != [make(2, "a", digits=[3, 3]).record(k).prompt for k in range(50)]
    assert base != [make(1, "b", digits=[3, 3]).record(k).prompt for k in range(50)]


@settings(max_examples=80, deadline=None)
@given(seed=SEEDS, key=KEYS, k=knobs())
def test_answer_is_the_value_of_the_expression(seed: int, key: int, k: dict[str, Any]) -> None:
    record = make(seed, **k).record(key)
    expression = record.metadata["expression"]
    tokens(expression)  # only numbers and operators, so eval is harmless here
    assert record.answer == str(eval(expression))
    assert record.prompt == f"What is {expression}?"
    assert record.key == key


@settings(max_examples=80, deadline=None)
@given(seed=SEEDS, key=KEYS, k=knobs())
def test_operands_have_the_configured_digits(seed: int, key: int, k: dict[str, Any]) -> None:
    operands, ops = tokens(make(seed, **k).record(key).metadata["expression"])
    lo, hi = k["digits"]
    assert len(operands) == k["operands"]
    assert len(ops) == k["operands"] - 1
    for x in operands:
        assert lo <= len(str(x)) <= hi, (x, k["digits"])


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, key=KEYS, k=knobs(allow_negative=True))
def test_only_configured_ops_appear(seed: int, key: int, k: dict[str, Any]) -> None:
    _, ops = tokens(make(seed, **k).record(key).metadata["expression"])
    assert set(ops) <= set(k["ops"])


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, key=KEYS, k=knobs(allow_negative=False))
def test_no_negative_answers_unless_allowed(seed: int, key: int, k: dict[str, Any]) -> None:
    record = make(seed, **k).record(key)
    assert int(record.answer or "") >= 0
    if "+" in k["ops"]:
        # Retries keep the configured operators; a subtraction chain that never lands ≥ 0 becomes a sum.
        assert set(tokens(record.metadata["expression"])[1]) <= set(k["ops"])


@pytest.mark.parametrize("operands", [2, 3, 8], ids=str)
def test_long_subtraction_chains_stay_non_negative(operands: int) -> None:
    src = make(5, ops=["-"], digits=[1, 2], operands=operands)
    answers = [int(src.record(k).answer or "") for k in range(200)]
    assert min(answers) >= 0


def test_allow_negative_gives_negative_answers() -> None:
    src = make(5, ops=["-"], digits=[1, 2], allow_negative=True)
    answers = [int(src.record(k).answer or "") for k in range(200)]
    assert min(answers) < 0
    assert max(answers) > 0


def test_precedence_is_the_usual_one() -> None:
    src = make(9, ops=["+", "-", "*"], digits=[1, 2], operands=4, allow_negative=True)
    for k in range(300):
        record = src.record(k)
        assert record.answer == str(eval(record.metadata["expression"]))
    assert any(
        "*" in src.record(k).metadata["expression"] and "+" in src.record(k).metadata["expression"] for k in range(300)
    )


def test_template_and_system_prompt() -> None:
    src = make(template="Compute {expression}. Then check {expression}.", system_prompt="Be brief.")
    record = src.record(3)
    expression = record.metadata["expression"]
    assert record.prompt == f"Compute {expression}. Then check {expression}."
    assert record.system_prompt == "Be brief."
    assert dict(record.metadata) == {"expression": expression}


@pytest.mark.parametrize(
    "template",
    ["What is {expression}? Put the answer in \\boxed{}.", "Solve {expression} and reply as {answer: ...}"],
    ids=["boxed", "json-ish"],
)
def test_template_with_other_braces_is_refused_at_load_or_rendered_literally(template: str) -> None:
    doc = {
        "name": "c",
        "sources": {"a": {"kind": "arithmetic", "template": template, "graders": ["numeric"]}},
        "stages": [{"name": "s", "until_step": 5, "mix": [{"source": "a"}]}],
    }
    try:
        spec = parse_spec(doc)
    except CurriculumError as exc:  # refusing it up front, with the YAML path, is fine too
        assert [path for path, _ in exc.problems] == ["sources.a.template"]
        return
    source = spec.sources["a"]
    assert isinstance(source, ArithmeticSourceSpec)
    record = ArithmeticSource("a", source, 0).record(0)
    assert record.prompt == template.replace("{expression}", record.metadata["expression"])


def test_is_infinite() -> None:
    src = make()
    assert src.size is None
    assert src.kind == "arithmetic"
    assert src.record(10**15).answer is not None


@pytest.mark.parametrize("key", [-1, -(10**9)], ids=str)
def test_negative_key_raises_key_error(key: int) -> None:
    with pytest.raises(KeyError):
        make().record(key)


def test_sample_id_round_trips() -> None:
    src = make(3, "add_1d")
    assert re.fullmatch(r"[0-9a-f]{10}", src.version)
    parsed = SampleId.parse(src.sample_id(42))
    assert parsed == SampleId("add_1d", src.version, 42)


def test_version_is_stable() -> None:
    assert make(3, digits=[1, 2]).version == make(3, digits=[1, 2]).version


@pytest.mark.parametrize(
    ("seed", "name", "knob_change"),
    [
        (4, "a", {}),
        (3, "b", {}),
        (3, "a", {"ops": ["+", "-"]}),
        (3, "a", {"digits": [1, 3]}),
        (3, "a", {"operands": 3}),
        (3, "a", {"allow_negative": True}),
        (3, "a", {"template": "Compute {expression}."}),
    ],
    ids=["seed", "name", "ops", "digits", "operands", "allow_negative", "template"],
)
def test_version_changes_with_seed_name_and_knobs(seed: int, name: str, knob_change: dict[str, Any]) -> None:
    base = make(3, "a", digits=[1, 2])
    other = make(seed, name, **{"digits": [1, 2], **knob_change})
    assert other.version != base.version


def test_version_ignores_what_does_not_change_the_records_keys() -> None:
    # Graders and on_error decide rewards, not which prompt sits behind a key.
    assert make(3, graders=["numeric", "think_format"], on_error=-1.0).version == make(3).version


# --- size -------------------------------------------------------------------------------------------------


def test_size_bounds_the_keys() -> None:
    src = make(size=5)
    assert src.size == 5
    assert [src.record(k).key for k in range(5)] == [0, 1, 2, 3, 4]
    for key in (5, 6, 10**15, -1):
        with pytest.raises(KeyError):
            src.record(key)


def test_size_does_not_change_the_records() -> None:
    endless, finite = make(3, digits=[1, 3]), make(3, digits=[1, 3], size=50)
    assert [finite.record(k) for k in range(50)] == [endless.record(k) for k in range(50)]


def test_version_without_a_size_is_the_one_sample_ids_always_had() -> None:
    # Pinned: an endless source's sample ids must not change when proctor learns new knobs.
    assert make(3, "a", digits=[1, 2]).version == "16157b4410"


def test_version_changes_with_the_size() -> None:
    versions = {make(3, digits=[1, 2], size=size).version for size in (None, 10, 11)}
    assert len(versions) == 3


# --- difficulty -------------------------------------------------------------------------------------------


def test_difficulty_spans_zero_to_one() -> None:
    assert make(ops=["+"], digits=[1, 1], operands=2).source_difficulty() == 0.0
    assert make(ops=["*"], digits=[18, 18], operands=8).source_difficulty() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("easier", "harder"),
    [
        ({"digits": [1, 2]}, {"digits": [1, 3]}),
        ({"digits": [1, 17]}, {"digits": [1, 18]}),
        ({"operands": 2}, {"operands": 3}),
        ({"operands": 7}, {"operands": 8}),
        ({"ops": ["+"]}, {"ops": ["+", "-"]}),
        ({"ops": ["-"]}, {"ops": ["*"]}),
    ],
    ids=["digits", "digits-top", "operands", "operands-top", "minus", "times"],
)
def test_difficulty_rises_with_each_knob(easier: dict[str, Any], harder: dict[str, Any]) -> None:
    low, high = make(**easier).source_difficulty(), make(**harder).source_difficulty()
    assert low is not None and high is not None
    assert low < high


def test_difficulty_ignores_the_smallest_digit_count_and_negatives() -> None:
    # Only the largest operands decide: [1, 3] and [3, 3] reach the same numbers.
    assert make(digits=[1, 3]).source_difficulty() == make(digits=[3, 3]).source_difficulty()
    assert make(ops=["-"], allow_negative=True).source_difficulty() == make(ops=["-"]).source_difficulty()


def test_shipped_ladder_rises_stage_by_stage() -> None:
    cur = load_curriculum(builtin_path("arithmetic"))
    hardest = []
    for stage in cur.stages:
        difficulties = [cur.sources[name].source_difficulty() for name, _ in stage.mix]
        assert None not in difficulties
        hardest.append(max(d for d in difficulties if d is not None))
    assert hardest == sorted(hardest)
    assert len(set(hardest)) == len(hardest)


def test_declared_difficulty_overrides_the_knobs() -> None:
    spec = ArithmeticSourceSpec.model_validate(
        {"kind": "arithmetic", "graders": ["numeric"], "ops": ["*"], "difficulty": 0.125}
    )
    src = build_source("a", spec, base_dir=Path("."), seed=0)
    assert src.source_difficulty() == 0.125
    assert src.derived_difficulty() == pytest.approx(1 / 3)
    assert make(ops=["*"]).source_difficulty() == pytest.approx(1 / 3)


def test_records_have_no_difficulty_of_their_own() -> None:
    assert make().record_difficulty(0) is None
