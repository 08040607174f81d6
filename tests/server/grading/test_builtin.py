"""Tests for the built-in graders in :mod:`proctor.server.grading.builtin`."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import (
    BUILTIN_GRADERS,
    exact_match,
    json_schema,
    json_valid,
    length_cap,
    math,
    numeric,
    regex,
    think_format,
)


def sample(completion: str, answer: str | None = None, **kw: Any) -> GradeInput:
    return GradeInput(prompt="Q?", completion=completion, answer=answer, **kw)


# --- registry ---------------------------------------------------------------------------------------------


def test_registry_has_exactly_the_builtin_names() -> None:
    assert set(BUILTIN_GRADERS) == {
        "code",
        "exact_match",
        "numeric",
        "math",
        "regex",
        "think_format",
        "json_valid",
        "json_schema",
        "length_cap",
        "reasoning_gym",
        "reasoning_core",
    }


@pytest.mark.parametrize("name", sorted(BUILTIN_GRADERS))
def test_registry_graders_take_the_sample_positionally_and_params_by_keyword_only(name: str) -> None:
    fn = BUILTIN_GRADERS[name]
    assert callable(fn)
    first, *rest = inspect.signature(fn).parameters.values()
    assert first.name == "sample"
    assert first.kind is inspect.Parameter.POSITIONAL_ONLY
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), name
    assert inspect.getdoc(fn)


def test_registry_is_read_only() -> None:
    registry: Any = BUILTIN_GRADERS
    with pytest.raises(TypeError):
        registry["mine"] = exact_match
    with pytest.raises(TypeError):
        del registry["numeric"]


def test_import_is_light() -> None:
    code = (
        "import sys, proctor.server.grading.builtin\n"
        "heavy = {'torch', 'fastapi', 'math_verify', 'sympy', 'jsonschema'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# --- exact_match ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("  paris \n", "Paris", 1.0),
        ("New   York\nCity", "new york city", 1.0),
        ("<think>maybe London</think>Paris", "Paris", 1.0),
        ("<think>Paris</think>London", "Paris", 0.0),
        ("Paris.", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(completion: str, answer: str, expected: float) -> None:
    assert exact_match(sample(completion, answer)) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("Paris", "Paris", 1.0), ("paris", "Paris", 0.0), ("PARIS", "paris", 0.0)],
)
def test_exact_match_case_sensitive(completion: str, answer: str, expected: float) -> None:
    assert exact_match(sample(completion, answer), case_sensitive=True) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [(" a  b ", "a  b", 1.0), ("a b", "a  b", 0.0), ("a\nb", "a b", 0.0)],
)
def test_exact_match_without_whitespace_normalization_still_strips(
    completion: str, answer: str, expected: float
) -> None:
    assert exact_match(sample(completion, answer), normalize_whitespace=False) == expected


def test_exact_match_needs_an_answer() -> None:
    with pytest.raises(ValueError, match=r"exact_match needs a reference answer.*answer_field"):
        exact_match(sample("Paris"))


# --- numeric ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("42", "42", 1.0),
        ("The answer is 42.", "42", 1.0),
        ("First 7, then 12, so 42", "42", 1.0),
        ("42, or maybe 41", "42", 0.0),
        ("It costs $1,234.50 in total", "1234.5", 1.0),
        ("1,234,567", "1234567", 1.0),
        ("-17", "-17", 1.0),
        ("+17", "17", 1.0),
        ("\u221217", "-17", 1.0),
        ("x = -0.5", "-0.5", 1.0),
        ("about .5", "0.5", 1.0),
        ("6.02e23 atoms", "6.02e+23", 1.0),
        ("1.5E-3", "0.0015", 1.0),
        ("3/4", "0.75", 1.0),
        ("-3/4", "-0.75", 1.0),
        ("50%", "50", 1.0),
        ("50%", "0.5", 0.0),
        ("the range 3-5", "5", 1.0),
        ("答案是42", "42", 1.0),
        ("use x2", "2", 0.0),
        ("\\boxed{42} and then 7 more", "42", 1.0),
        ("\\boxed{1} then \\boxed{42}", "42", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("$-\\dfrac{1}{8}$", "-0.125", 1.0),
        ("\\boxed{1{,}234}", "1234", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{none} but 42", "42", 0.0),
        ("1/0", "0", 0.0),
        ("no number here", "42", 0.0),
        ("", "42", 0.0),
        ("<think>42? no, 41</think>The answer is 42", "42", 1.0),
        ("<think>it is 42</think>I give up", "42", 0.0),
    ],
)
def test_numeric(completion: str, answer: str, expected: float) -> None:
    assert numeric(sample(completion, answer)) == expected


@pytest.mark.parametrize("answer", [" 1,234 ", "1234.0", "1.234e3", "+1234", "2468/2", "\\frac{2468}{2}"])
def test_numeric_reads_the_reference_in_any_supported_form(answer: str) -> None:
    assert numeric(sample("1234", answer)) == 1.0


@pytest.mark.parametrize(
    ("completion", "params", "expected"),
    [
        ("100.00001", {}, 1.0),
        ("100.01", {}, 0.0),
        ("100.01", {"rel_tol": 1e-3}, 1.0),
        ("100.5", {"abs_tol": 1}, 1.0),
        ("101.5", {"abs_tol": 1}, 0.0),
        ("100.01", {"rel_tol": "1e-3"}, 1.0),
    ],
)
def test_numeric_tolerances(completion: str, params: dict[str, Any], expected: float) -> None:
    assert numeric(sample(completion, "100"), **params) == expected


def test_numeric_needs_an_answer() -> None:
    with pytest.raises(ValueError, match="numeric needs a reference answer"):
        numeric(sample("42"))


@pytest.mark.parametrize("answer", ["forty-two", "42 apples", "", "1/0", "1.2.3"])
def test_numeric_rejects_a_non_numeric_reference_naming_it(answer: str) -> None:
    with pytest.raises(ValueError, match=rf"reference answer '{answer}' is not a number.*plain number"):
        numeric(sample("42", answer))


@pytest.mark.parametrize(("param", "value"), [("rel_tol", -1e-6), ("abs_tol", "tiny"), ("rel_tol", float("nan"))])
def test_numeric_rejects_a_bad_tolerance(param: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"numeric: {param} must be a number >= 0, got"):
        numeric(sample("42", "42"), **{param: value})


_FORMATS = [str, repr, "{:,}".format, "{:+}".format, "{:.17e}".format, "{:,.17g}".format]


@given(
    value=st.integers(-(10**18), 10**18) | st.floats(allow_nan=False, allow_infinity=False),
    fmt=st.sampled_from(_FORMATS),
)
def test_numeric_property_last_number_of_a_sentence_is_read(value: float, fmt: Any) -> None:
    completion = f"After 3 tries and 2.5 hours, the answer is {fmt(value)}."
    assert numeric(sample(completion, str(value))) == 1.0


# --- math ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("The answer is \\boxed{42}.", "\\boxed{42}", 1.0),
        ("The answer is 42", "$42$", 1.0),
        ("So $\\frac{1}{2}$", "0.5", 1.0),
        ("So \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1 + x^2}", "x^2+1", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{3\\pi}", "3 \\pi", 1.0),
        ("\\boxed{3}", "3 \\pi", 0.0),
        ("The answer is \\boxed{41}.", "42", 0.0),
        ("I do not know", "42", 0.0),
        ("", "42", 0.0),
        ("<think>\\boxed{42}</think>\\boxed{41}", "42", 0.0),
        ("<think>\\boxed{41}</think>\\boxed{42}", "42", 1.0),
    ],
)
def test_math(completion: str, answer: str, expected: float) -> None:
    assert math(sample(completion, answer)) == expected


def test_math_needs_an_answer() -> None:
    with pytest.raises(ValueError, match="math needs a reference answer"):
        math(sample("\\boxed{42}"))


@pytest.mark.parametrize("answer", ["", "\\boxed{}"])
def test_math_rejects_a_reference_that_parses_to_nothing(answer: str) -> None:
    with pytest.raises(ValueError, match=r"math: could not parse the reference answer .*write it as LaTeX"):
        math(sample("\\boxed{42}", answer))


@pytest.mark.parametrize("timeout_s", [0, -1])
def test_math_rejects_a_non_positive_timeout(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="math: timeout_s must be > 0"):
        math(sample("\\boxed{42}", "42"), timeout_s=timeout_s)


@pytest.fixture
def no_real_timer() -> Iterator[None]:
    # pytest-timeout may have armed ITIMER_REAL, and math rightly skips its own timeout while any timer runs;
    # park it so these tests see the path a bare grader worker takes.
    saved = signal.setitimer(signal.ITIMER_REAL, 0)
    yield
    signal.setitimer(signal.ITIMER_REAL, *saved)


@pytest.mark.usefixtures("no_real_timer")
def test_math_works_off_the_main_thread() -> None:
    results: list[float | BaseException] = []

    def run() -> None:
        try:
            results.append(math(sample("\\boxed{\\frac{1}{2}}", "0.5")))
        except BaseException as e:
            results.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert results == [1.0]


def _spy_parse_timeouts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import math_verify

    seen: list[Any] = []
    real_parse = math_verify.parse

    def parse(text: str, **kw: Any) -> Any:
        seen.append(kw.get("parsing_timeout"))
        return real_parse(text, **kw)

    monkeypatch.setattr(math_verify, "parse", parse)
    return seen


@pytest.mark.usefixtures("no_real_timer")
def test_math_passes_its_timeout_to_math_verify_on_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a plain number: those never reach math_verify.
    seen = _spy_parse_timeouts(monkeypatch)
    assert math(sample("\\boxed{\\sqrt{43}}", "\\sqrt{43}"), timeout_s=2.5) == 1.0
    assert seen == [3, 3]  # signal.alarm takes whole seconds


@pytest.mark.usefixtures("no_real_timer")
def test_math_leaves_a_callers_timer_running(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_parse_timeouts(monkeypatch)
    signal.setitimer(signal.ITIMER_REAL, 60)
    assert math(sample("\\boxed{\\sqrt{47}}", "\\sqrt{47}")) == 1.0
    assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert seen == [None, None]


# --- regex ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "params", "expected"),
    [
        ("The answer is (B).", {"pattern": r"\(B\)"}, 1.0),
        ("The answer is (B).", {"pattern": r"\(C\)"}, 0.0),
        ("the answer is (b).", {"pattern": r"\(B\)", "ignore_case": True}, 1.0),
        ("the answer is (b).", {"pattern": r"\(B\)"}, 0.0),
        ("B", {"pattern": "[A-D]", "mode": "fullmatch"}, 1.0),
        ("B.", {"pattern": "[A-D]", "mode": "fullmatch"}, 0.0),
        ("<think>(B)</think>(C)", {"pattern": r"\(B\)"}, 0.0),
        ("<think>(C)</think>B", {"pattern": "B", "mode": "fullmatch"}, 1.0),
    ],
)
def test_regex(completion: str, params: dict[str, Any], expected: float) -> None:
    assert regex(sample(completion), **params) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("color", "colou?r", 1.0), ("colour", "colou?r", 1.0), ("colr", "colou?r", 0.0)],
)
def test_regex_from_answer(completion: str, answer: str, expected: float) -> None:
    assert regex(sample(completion, answer), from_answer=True, mode="fullmatch") == expected


def test_regex_rejects_a_bad_mode() -> None:
    bad_mode: Any = "match"
    with pytest.raises(ValueError, match="regex: mode must be 'search' or 'fullmatch', got 'match'"):
        regex(sample("B"), pattern="B", mode=bad_mode)


def test_regex_needs_a_pattern() -> None:
    with pytest.raises(ValueError, match=r"regex needs a pattern: set params: \{pattern: \.\.\.\}"):
        regex(sample("B"))


def test_regex_from_answer_needs_an_answer() -> None:
    with pytest.raises(ValueError, match=r"regex \(from_answer\) needs a reference answer"):
        regex(sample("B"), from_answer=True)


def test_regex_rejects_pattern_with_from_answer() -> None:
    with pytest.raises(ValueError, match="regex: give either pattern or from_answer: true, not both"):
        regex(sample("B", "B"), pattern="B", from_answer=True)


def test_regex_rejects_an_invalid_pattern_naming_it_and_the_error() -> None:
    with pytest.raises(ValueError, match=r"regex: invalid pattern '\(B': missing \), unterminated subpattern"):
        regex(sample("B"), pattern="(B")


# --- think_format -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>reasoning</think>answer", 1.0),
        ("\n  <think>reasoning</think>\n\nanswer", 1.0),
        ("<think></think>answer", 1.0),
        ("<think>reasoning</think>", 0.0),
        ("<think>reasoning</think>  \n", 0.0),
        ("answer", 0.0),
        ("preamble <think>reasoning</think>answer", 0.0),
        ("<think>never closed, answer", 0.0),
        ("reasoning</think>answer", 0.0),
        ("<think>a<think>b</think>c</think>answer", 0.0),
        ("<think>a</think>answer<think>b</think>", 0.0),
        ("<think>a</think>answer</think>", 0.0),
        ("<THINK>a</THINK>answer", 0.0),
    ],
)
def test_think_format(completion: str, expected: float) -> None:
    assert think_format(sample(completion)) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("<think>a</think>", 1.0), ("<think>a</think>answer", 1.0), ("<think>a</think><think>b</think>", 0.0)],
)
def test_think_format_without_an_answer_required(completion: str, expected: float) -> None:
    assert think_format(sample(completion), require_answer=False) == expected


# --- json_valid -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ('{"a": 1}', 1.0),
        ('  [1, 2, "x"]\n', 1.0),
        ("42", 1.0),
        ('{"a": 1,}', 0.0),
        ("{'a': 1}", 0.0),
        ("", 0.0),
        ('Here you go:\n```json\n{"a": 1}\n```\nDone.', 1.0),
        ('```JSON\n{"a": 1}\n```', 1.0),
        ('Here:\n```\n{"a": 1}\n```', 1.0),
        ('```{"a": 1}```', 1.0),
        ('```json\n{"a": 1,}\n```', 0.0),
        ('```python\n{"a": 1}\n```', 0.0),
        ('```json\n{oops}\n```\nfixed:\n```json\n{"a": 1}\n```', 1.0),
        ('<think>{"a": 1}</think>not json', 0.0),
        ('<think>not json</think>{"a": 1}', 1.0),
    ],
)
def test_json_valid(completion: str, expected: float) -> None:
    assert json_valid(sample(completion)) == expected


@pytest.mark.parametrize(("completion", "expected"), [('{"a": 1}', 1.0), ('```json\n{"a": 1}\n```', 0.0)])
def test_json_valid_without_fences(completion: str, expected: float) -> None:
    assert json_valid(sample(completion), allow_fence=False) == expected


# --- json_schema ------------------------------------------------------------------------------------------

_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ('{"name": "Ada", "age": 36}', 1.0),
        ('```json\n{"name": "Ada", "age": 36}\n```', 1.0),
        ('{"name": "Ada"}', 0.0),
        ('{"name": "Ada", "age": -1}', 0.0),
        ('{"name": "Ada", "age": 36, "x": 1}', 0.0),
        ('["Ada", 36]', 0.0),
        ("not json", 0.0),
        ('<think>{"name": "Ada", "age": 36}</think>{}', 0.0),
    ],
)
def test_json_schema(completion: str, expected: float) -> None:
    assert json_schema(sample(completion), schema=_PERSON) == expected


def test_json_schema_uses_draft_2020_12() -> None:
    schema = {"type": "array", "prefixItems": [{"type": "string"}], "items": False}
    assert json_schema(sample('["a"]'), schema=schema) == 1.0
    assert json_schema(sample('["a", 1]'), schema=schema) == 0.0


@pytest.mark.parametrize("stored", [_PERSON, '{"type": "object", "required": ["name", "age"]}'])
def test_json_schema_from_metadata_dict_or_json_string(stored: Any) -> None:
    good = sample('{"name": "Ada", "age": 36}', metadata={"schema": stored})
    bad = sample('{"name": "Ada"}', metadata={"schema": stored})
    assert json_schema(good, schema_field="schema") == 1.0
    assert json_schema(bad, schema_field="schema") == 0.0


def test_json_schema_needs_a_schema() -> None:
    with pytest.raises(ValueError, match=r"json_schema needs a schema: set params: \{schema: \{\.\.\.\}\}"):
        json_schema(sample("{}"))


def test_json_schema_needs_the_metadata_field() -> None:
    with pytest.raises(ValueError, match="json_schema: the record has no metadata field 'schema'"):
        json_schema(sample("{}", metadata={"other": {}}), schema_field="schema")


def test_json_schema_rejects_a_metadata_schema_that_is_not_json() -> None:
    with pytest.raises(ValueError, match="json_schema: metadata field 'schema' is not valid JSON"):
        json_schema(sample("{}", metadata={"schema": "{type: object"}), schema_field="schema")


def test_json_schema_rejects_both_schema_and_schema_field() -> None:
    with pytest.raises(ValueError, match="json_schema: give either schema or schema_field, not both"):
        json_schema(sample("{}", metadata={"s": {}}), schema={}, schema_field="s")


@pytest.mark.parametrize("schema", [{"type": "objekt"}, {"minimum": "zero"}, {"pattern": "("}])
def test_json_schema_rejects_an_invalid_schema(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"json_schema: the schema is not a valid JSON Schema \(2020-12\)"):
        json_schema(sample("{}"), schema=schema)


@pytest.mark.parametrize("schema", [["type", "object"], 42])
def test_json_schema_rejects_a_schema_that_is_not_an_object(schema: Any) -> None:
    with pytest.raises(ValueError, match="json_schema: a schema must be a JSON object or boolean, got"):
        json_schema(sample("{}"), schema=schema)


# --- length_cap -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "soft_margin", "expected"),
    [
        (0, 0, 1.0),
        (100, 0, 1.0),
        (101, 0, 0.0),
        (100, 50, 1.0),
        (125, 50, 0.5),
        (140, 50, 0.2),
        (150, 50, 0.0),
        (10_000, 50, 0.0),
    ],
)
def test_length_cap(tokens: int, soft_margin: int, expected: float) -> None:
    got = length_cap(sample("x", completion_tokens=tokens), max_tokens=100, soft_margin=soft_margin)
    assert got == pytest.approx(expected)


def test_length_cap_needs_completion_tokens() -> None:
    with pytest.raises(ValueError, match="length_cap needs completion_tokens: send completion_tokens with each"):
        length_cap(sample("x"), max_tokens=100)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, "length_cap: max_tokens must be >= 1, got 0"),
        ({"max_tokens": 100, "soft_margin": -1}, "length_cap: soft_margin must be >= 0, got -1"),
    ],
)
def test_length_cap_rejects_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        length_cap(sample("x", completion_tokens=5), **params)


# --- properties shared by the answer graders --------------------------------------------------------------

_ANSWER_GRADERS: list[tuple[str, dict[str, Any], str | None]] = [
    ("exact_match", {}, "42"),
    ("numeric", {}, "42"),
    ("regex", {"pattern": "4[0-9]"}, None),
    ("json_valid", {}, None),
    ("json_schema", {"schema": {"type": "integer"}}, None),
]
_TEXT = st.text() | st.text(alphabet="0123456789 .,-/e{}\\boxed<>think`json\n", max_size=40)


@pytest.mark.parametrize(("name", "params", "answer"), _ANSWER_GRADERS)
@settings(deadline=None, max_examples=50)
@given(reasoning=_TEXT, response=_TEXT)
def test_property_reasoning_never_changes_an_answer_graders_score(
    name: str, params: dict[str, Any], answer: str | None, reasoning: str, response: str
) -> None:
    assume("</think>" not in reasoning and "<think>" not in response)
    grade = BUILTIN_GRADERS[name]
    plain = grade(sample(response, answer), **params)
    with_reasoning = grade(sample(f"<think>{reasoning}</think>{response}", answer), **params)
    assert with_reasoning == plain
