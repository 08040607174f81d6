"""Tests for the ``math`` grader: its exact plain-number path, its math_verify fallback, and that they agree.

Every verdict here is checked three ways: the grader, math_verify alone (parsed the way the grader's fallback
parses), and the expected value written in the table. Where both sides are plain numbers the grader must
decide without math_verify, except in the forms math_verify reads differently, where it must ask it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import math_verify
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import ExprExtractionConfig, LatexExtractionConfig

from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import math
from proctor.server.grading.numbers import plain_number

# What the grader's fallback parses with, reference and response alike;
# test_the_fallback_parses_with_these_configs holds the grader to it.
CONFIGS = [LatexExtractionConfig(), ExprExtractionConfig()]
_DELIMITED = re.compile(r"\\boxed|\$|\\\(|\\\[")


def sample(completion: str, answer: str | None) -> GradeInput:
    return GradeInput(prompt="Q?", completion=completion, answer=answer)


def math_verify_alone(reference: str, response: str) -> float:
    """The verdict of math_verify alone: no fast path, no cache, a bare reference wrapped in ``\\boxed{}``."""
    gold_text = reference if _DELIMITED.search(reference) else f"\\boxed{{{reference}}}"
    # No timeouts: math_verify's alarm(0) would cancel the timer pytest-timeout runs on.
    gold = math_verify.parse(gold_text, extraction_config=CONFIGS, parsing_timeout=None)
    pred = math_verify.parse(response, extraction_config=CONFIGS, parsing_timeout=None)
    return 1.0 if pred and math_verify.verify(gold, pred, timeout_seconds=None) else 0.0


@pytest.fixture
def parse_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every call the grader makes to ``math_verify.parse``, as ``(text, keyword arguments)``."""
    calls: list[tuple[str, dict[str, Any]]] = []
    real_parse = math_verify.parse

    def parse(text: str, **kw: Any) -> Any:
        calls.append((text, kw))
        return real_parse(text, **kw)

    monkeypatch.setattr(math_verify, "parse", parse)
    yield calls


# --- the table: grader == math_verify alone == expected ----------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    reference: str
    completion: str
    expected: float
    # "fast": both sides are plain numbers math_verify reads as plain arithmetic does, so the grader decides
    # alone; "math_verify": the grader must ask it (not plain numbers, or a form math_verify reads otherwise).
    path: Literal["fast", "math_verify"]


CASES = [
    # equal values written differently
    Case("decimal-vs-slash", "0.5", "1/2", 1.0, "fast"),
    Case("slash-vs-decimal", "1/2", "0.5", 1.0, "fast"),
    Case("frac-vs-decimal", "\\frac{1}{2}", "0.5", 1.0, "fast"),
    Case("decimal-vs-bare-frac", "0.5", "\\frac{1}{2}", 1.0, "fast"),
    Case("decimal-vs-dfrac-in-dollars", "0.5", "$\\dfrac{1}{2}$", 1.0, "fast"),
    Case("slash-vs-boxed-frac", "3/4", "\\boxed{\\frac{3}{4}}", 1.0, "fast"),
    Case("decimal-vs-boxed-slash", "0.75", "\\boxed{3/4}", 1.0, "fast"),
    Case("tenth-is-exact", "0.1", "1/10", 1.0, "fast"),
    Case("unreduced-fraction", "2", "4/2", 1.0, "fast"),
    Case("trailing-zero-decimal", "42", "42.0", 1.0, "fast"),
    Case("no-leading-zero", "0.5", ".5", 1.0, "fast"),
    Case("minus-zero", "0", "-0", 1.0, "fast"),
    Case("whitespace-around", "42", "  \n42\n", 1.0, "fast"),
    # \boxed and delimiters
    Case("boxed", "42", "\\boxed{42}", 1.0, "fast"),
    Case("boxed-reference", "\\boxed{42}", "42", 1.0, "fast"),
    Case("dollar-vs-paren", "$42$", "\\(42\\)", 1.0, "fast"),
    Case("boxed-in-a-sentence", "42", "The answer is \\boxed{42}.", 1.0, "math_verify"),
    Case("last-boxed-counts", "42", "\\boxed{42} \\boxed{41}", 0.0, "math_verify"),
    Case("two-formulas-are-a-set", "42", "$42$ or $41$", 0.0, "math_verify"),
    # units and percent
    Case("units-in-response", "5", "5 cm", 1.0, "math_verify"),
    Case("units-in-reference", "5 cm", "5", 1.0, "math_verify"),
    Case("wrong-number-with-units", "5", "6 cm", 0.0, "math_verify"),
    Case("percent-reference-vs-number", "50%", "50", 1.0, "math_verify"),
    Case("percent-reference-vs-fraction", "50%", "0.5", 1.0, "math_verify"),
    Case("percent-response", "0.5", "50%", 1.0, "math_verify"),
    Case("latex-percent", "50%", "\\boxed{50\\%}", 1.0, "math_verify"),
    # signs
    Case("negative", "-3", "-3", 1.0, "fast"),
    Case("sign-matters", "-3", "3", 0.0, "fast"),
    Case("unicode-minus-in-dollars", "-3", "$\u22123$", 1.0, "fast"),
    Case("unicode-minus-reference", "\u22123", "-3", 1.0, "fast"),
    Case("boxed-negative", "-7", "\\boxed{-7}", 1.0, "fast"),
    Case("plus-in-dollars", "3", "$+3$", 1.0, "fast"),
    Case("spaced-minus-is-not-a-number", "-7", "- 7", 0.0, "math_verify"),
    Case("inline-math-over-lines-is-not-read", "3", "$\n+3\n$", 0.0, "math_verify"),
    Case("boxed-over-lines", "3", "\\boxed{\n+3\n}", 1.0, "fast"),
    # plain numbers math_verify reads otherwise when bare, so the grader asks it
    Case("bare-unicode-minus-reads-as-nothing", "-3", "\u22123", 0.0, "math_verify"),
    Case("bare-plus-reads-as-nothing", "3", "+3", 0.0, "math_verify"),
    Case("bare-dfrac-reads-as-nothing", "0.5", "\\dfrac{1}{2}", 0.0, "math_verify"),
    Case("bare-latex-thousands-reads-as-1", "1234", "1{,}234", 0.0, "math_verify"),
    Case("bare-negative-leading-zero-reads-as-nothing", "-42", "-042", 0.0, "math_verify"),
    Case("bare-negative-leading-dot-reads-as-nothing", "-0.5", "-.5", 0.0, "math_verify"),
    Case("bare-leading-zero-numerator-reads-as-3", "3/4", "03/4", 0.0, "math_verify"),
    Case("rounded-to-6-places-is-equal", "1/3", "0.3333333", 1.0, "math_verify"),
    Case("within-rounding-but-not-equal", "1", "1.0000001", 0.0, "math_verify"),
    Case("equal-18-digit-decimals-differ-in-floats", "999999999999999.999", "999999999999999.9990", 0.0, "math_verify"),
    # intervals and sets
    Case("interval", "(1, 2]", "\\boxed{(1, 2]}", 1.0, "math_verify"),
    Case("interval-closed-vs-half-open", "(1, 2]", "\\boxed{[1, 2]}", 0.0, "math_verify"),
    Case("interval-open-vs-half-open", "(1, 2]", "$(1, 2)$", 0.0, "math_verify"),
    Case("bare-interval-reads-as-its-end", "(1, 2]", "(1, 2]", 0.0, "math_verify"),
    Case("set-in-any-order", "\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", 1.0, "math_verify"),
    Case("set-wrong-element", "\\{1, 2\\}", "\\boxed{\\{1, 3\\}}", 0.0, "math_verify"),
    Case("set-as-two-formulas", "\\{1, 2\\}", "$1$ and $2$", 1.0, "math_verify"),
    # wrong answers sharing digits with the right one
    Case("prefix-of-answer", "123", "12", 0.0, "fast"),
    Case("answer-is-prefix", "12", "123", 0.0, "fast"),
    Case("boxed-extra-digit", "12", "\\boxed{123}", 0.0, "fast"),
    Case("misplaced-point", "1.5", "15", 0.0, "fast"),
    Case("missing-point", "15", "1.5", 0.0, "fast"),
    Case("close-but-not-rounding-close", "1/3", "0.33", 0.0, "fast"),
    # reasoning is not the answer
    Case(
        "right-in-reasoning-wrong-after", "42", "<think>Maybe 42? 6*7 = 42.</think>The answer is 41", 0.0, "math_verify"
    ),
    Case(
        "wrong-in-reasoning-right-after", "41", "<think>Maybe 42? 6*7 = 42.</think>The answer is 41", 1.0, "math_verify"
    ),
    Case("boxed-only-in-reasoning", "42", "<think>\\boxed{42}</think>", 0.0, "math_verify"),
    # empty answers
    Case("empty-response", "42", "", 0.0, "math_verify"),
    Case("only-whitespace-after-think", "42", "<think>42</think>   ", 0.0, "math_verify"),
    # thousands separators
    Case("thousands-reference", "1,234", "1234", 1.0, "fast"),
    Case("thousands-response", "1234", "1,234", 1.0, "fast"),
    Case("latex-thousands-boxed", "1234", "\\boxed{1{,}234}", 1.0, "fast"),
    Case("latex-thousands-reference", "1{,}234", "1234", 1.0, "fast"),
    Case("millions", "1,234,567", "1234567", 1.0, "fast"),
    Case("thousands-with-decimals", "1,234.5", "1234.5", 1.0, "fast"),
    # leading zeros
    Case("leading-zero-response", "42", "042", 1.0, "fast"),
    Case("leading-zero-reference", "042", "42", 1.0, "fast"),
    Case("negative-leading-zero-in-dollars", "-42", "$-042$", 1.0, "fast"),
    # equations
    Case("assignment-response", "19", "x = 19", 1.0, "math_verify"),
    Case("assignment-reference", "x = 19", "19", 1.0, "math_verify"),
    Case("assignment-both", "x = 19", "\\boxed{x = 19}", 1.0, "math_verify"),
    Case("assignment-other-variable", "x = 19", "\\boxed{y = 19}", 0.0, "math_verify"),
    Case("assignment-in-dollars", "19", "$x = 19$", 1.0, "math_verify"),
    # large integers keep every digit
    Case("large-integer", "12345678901234567890", "12345678901234567890", 1.0, "fast"),
    Case("large-integer-off-by-one", "12345678901234567890", "12345678901234567891", 0.0, "fast"),
    Case("large-integer-thousands", "12345678901234567890", "12,345,678,901,234,567,890", 1.0, "fast"),
    # not plain numbers
    Case("exponent-notation-reads-as-1", "1000", "1e3", 0.0, "math_verify"),
    Case("trailing-point", "42", "42.", 1.0, "math_verify"),
    Case("answer-in-a-sentence", "42", "The answer is 42", 1.0, "math_verify"),
    Case("last-number-counts", "42", "42, or maybe 41", 0.0, "math_verify"),
    Case("division-by-zero", "1/0", "1/0", 0.0, "math_verify"),
    Case("radicals", "\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0, "math_verify"),
    Case("polynomial", "x^2+1", "$1 + x^2$", 1.0, "math_verify"),
    Case("pi", "\\pi/4", "\\boxed{\\frac{\\pi}{4}}", 1.0, "math_verify"),
    Case("pi-to-6-places", "\\pi/4", "0.785398", 1.0, "math_verify"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_math_agrees_with_math_verify_alone(case: Case, parse_calls: list[tuple[str, dict[str, Any]]]) -> None:
    response = sample(case.completion, case.reference).response
    assert math_verify_alone(case.reference, response) == case.expected
    parse_calls.clear()
    assert math(sample(case.completion, case.reference)) == case.expected
    assert bool(parse_calls) == (case.path == "math_verify")
    if case.path == "fast":
        want, got = plain_number(case.reference), plain_number(response)
        assert want is not None
        assert got is not None
        assert (1.0 if got == want else 0.0) == case.expected


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


def test_the_fallback_parses_with_these_configs(parse_calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert math(sample("\\boxed{\\sqrt{53}}", "\\sqrt{53}")) == 1.0
    # The reference (wrapped in \\boxed{}: it has no delimiter), then the response.
    assert [text for text, _ in parse_calls] == ["\\boxed{\\sqrt{53}}", "\\boxed{\\sqrt{53}}"]
    assert all(kw["extraction_config"] == CONFIGS for _, kw in parse_calls)


# --- the fast path, in a fresh interpreter ----------------------------------------------------------------


def test_plain_numbers_are_graded_without_math_verify_or_sympy() -> None:
    code = (
        "import sys\n"
        "from proctor.server.grading.base import GradeInput\n"
        "from proctor.server.grading.builtin import math\n"
        "cases = [('42', '<think>6*7</think>42', 1.0), ('3/4', '\\\\boxed{0.75}', 1.0), ('-7', '7', 0.0),\n"
        "         ('1,234', '$1234$', 1.0), ('0.25', '\\\\frac{1}{3}', 0.0)]\n"
        "for answer, completion, expected in cases:\n"
        "    assert math(GradeInput(prompt='', completion=completion, answer=answer)) == expected\n"
        "heavy = {'math_verify', 'sympy'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- every plain-number pair: grader == math_verify alone ---------------------------------------------------


def _thousands(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def _decimal(v: Fraction) -> str | None:
    """``v`` written out in full as a decimal, if that takes at most 9 places."""
    for places in range(10):
        scaled = v * 10**places
        if scaled.denominator == 1:
            whole, part = divmod(abs(scaled.numerator), 10**places)
            sign = "-" if v < 0 else ""
            return f"{sign}{whole}" if places == 0 else f"{sign}{whole}.{part:0{places}d}"
    return None


@st.composite
def written(draw: st.DrawFn, v: Fraction) -> str:
    """``v`` as a plain number, in one of the ways a reference or a model might write it."""
    sign = "-" if v < 0 else ""
    num, den = abs(v.numerator), v.denominator
    k = draw(st.sampled_from([1, 1, 2, 3]))
    forms = [
        f"{sign}{num * k}/{den * k}",
        f"{sign}\\frac{{{num * k}}}{{{den * k}}}",
        f"{sign}\\dfrac{{{num}}}{{{den}}}",
    ]
    if v < 0:
        forms += [f"\u2212{num}/{den}", f"\\frac{{-{num}}}{{{den}}}"]
    else:
        forms += [f"+{num}/{den}"]
    decimal = _decimal(v)
    if decimal is not None:
        forms += [decimal, "0" + decimal if v >= 0 else "-0" + decimal[1:]]
        if "." in decimal:
            forms.append(decimal + "0")
        if decimal.lstrip("-").startswith("0."):
            forms.append(decimal.replace("0.", ".", 1))
    if den == 1:
        forms += [_thousands(v.numerator, ","), _thousands(v.numerator, "{,}"), f"{v.numerator}.0"]
    text = draw(st.sampled_from(forms))
    wrapper = draw(
        st.sampled_from(
            ["{}", " {}\n", "${}$", "$ {} $", "\\({}\\)", "\\boxed{{{}}}", "$\\boxed{{{}}}$", "\\boxed{{\n{} }}"]
        )
    )
    return wrapper.format(text)


_VALUES = st.one_of(
    st.integers(-(10**20), 10**20).map(Fraction),
    st.builds(Fraction, st.integers(-(10**9), 10**9), st.sampled_from([10**k for k in range(1, 9)])),
    st.fractions(min_value=-(10**8), max_value=10**8, max_denominator=10**4),
    st.sampled_from([Fraction(0), Fraction(1, 3), Fraction(-2, 3), Fraction(999999999999999999, 1000)]),
)


@st.composite
def pairs(draw: st.DrawFn) -> tuple[Fraction, Fraction]:
    v = draw(_VALUES)
    nudge = draw(st.integers(1, 15).map(lambda k: Fraction(1, 10**k)))
    u = draw(st.sampled_from([v, v, v + nudge, v - nudge, -v, v * (1 + nudge)]) | _VALUES)
    return v, u


@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_property_plain_number_pairs_get_the_verdict_math_verify_gives(data: st.DataObject) -> None:
    v, u = data.draw(pairs())
    reference, response = data.draw(written(v)), data.draw(written(u))
    assert plain_number(reference) == v
    assert plain_number(response) == u
    assert math(sample(response, reference)) == math_verify_alone(reference, response)


# --- the reference cache ----------------------------------------------------------------------------------

_CACHED_REFERENCE = "\\frac{\\sqrt{3}}{2}"
_COMPLETIONS = [
    "$\\boxed{\\frac{\\sqrt{3}}{2}}$",
    "\\boxed{\\frac{1}{2}}",
    "<think>cos 30°</think>$\\frac{\\sqrt 3}{2}$",
    "<think>sin 60°</think>$\\sin(60^\\circ)$",
    "\\boxed{\\frac{3}{2\\sqrt{3}}}",
    "0.866025",
    "0.8660",
    "\\boxed{\\sqrt{3}}",
    "The answer is \\boxed{\\frac{\\sqrt{3}}{2}}.",
    "I do not know",
    "",
    "42",
]


def test_the_reference_cache_changes_no_verdict(parse_calls: list[tuple[str, dict[str, Any]]]) -> None:
    expected = [math_verify_alone(_CACHED_REFERENCE, sample(c, None).response) for c in _COMPLETIONS]
    assert 0.0 in expected
    assert 1.0 in expected
    parse_calls.clear()
    for order in (_COMPLETIONS, _COMPLETIONS[::-1], _COMPLETIONS):
        got = [math(sample(c, _CACHED_REFERENCE)) for c in order]
        assert got == [expected[_COMPLETIONS.index(c)] for c in order]
    reference_parses = [text for text, _ in parse_calls if text == f"\\boxed{{{_CACHED_REFERENCE}}}"]
    assert len(reference_parses) == 1


@pytest.mark.parametrize("answer", ["", "\\boxed{}", "$$"])
def test_an_unparseable_reference_raises_every_time(answer: str) -> None:
    for _ in range(3):
        with pytest.raises(ValueError, match=r"math: could not parse the reference answer .*write it as LaTeX"):
            math(sample("\\boxed{42}", answer))


def test_a_failed_reference_parse_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a parse that timed out looks like: math_verify gives nothing. The next call must parse again.
    real_parse = math_verify.parse
    fail = [True]

    def parse(text: str, **kw: Any) -> Any:
        return [] if fail[0] else real_parse(text, **kw)

    monkeypatch.setattr(math_verify, "parse", parse)
    completion, reference = "\\boxed{\\sqrt{59}}", "\\sqrt{59}"
    with pytest.raises(ValueError, match=r"could not parse the reference answer '\\\\sqrt\{59\}'"):
        math(sample(completion, reference))
    fail[0] = False
    assert math(sample(completion, reference)) == 1.0


# --- plain_number -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", Fraction(42)),
        ("0", Fraction(0)),
        ("-0", Fraction(0)),
        ("-7", Fraction(-7)),
        ("+7", Fraction(7)),
        ("\u22127", Fraction(-7)),
        ("007", Fraction(7)),
        ("1,234", Fraction(1234)),
        ("1{,}234", Fraction(1234)),
        ("-1,234,567.25", Fraction(-123456725, 100)),
        ("0.25", Fraction(1, 4)),
        ("0.1", Fraction(1, 10)),
        (".5", Fraction(1, 2)),
        ("2.50", Fraction(5, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("6/8", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("\\tfrac{3}{4}", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("\\frac{3}{-4}", Fraction(-3, 4)),
        ("-\\frac{-3}{4}", Fraction(3, 4)),
        ("$42$", Fraction(42)),
        ("$ 42 $", Fraction(42)),
        ("\\(42\\)", Fraction(42)),
        ("\\boxed{42}", Fraction(42)),
        ("  \\boxed{ 42 }\n", Fraction(42)),
        ("$\\boxed{-\\frac{1}{2}}$", Fraction(-1, 2)),
        ("\\(\\boxed{1{,}000}\\)", Fraction(1000)),
        ("123456789012345678901234567890", Fraction(123456789012345678901234567890)),
        ("0.000000000000000000001", Fraction(1, 10**21)),
    ],
)
def test_plain_number_reads(text: str, value: Fraction) -> None:
    got = plain_number(text)
    assert got == value
    assert isinstance(got, Fraction)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "forty-two",
        "5 cm",
        "50%",
        "50\\%",
        "x = 19",
        "x",
        "(1, 2]",
        "\\{1, 2\\}",
        "1, 2",
        "$1$ and $2$",
        "42 or 41",
        "1e3",
        "1E3",
        "42.",
        "1.2.3",
        "1/2/3",
        "--3",
        "+-3",
        "3-",
        "- 3",
        "3 / 4",
        "1/0",
        "\\frac{1}{0}",
        "\\frac{1}{x}",
        "\\frac{1.5}{2}",
        "\\frac12",
        "\\sqrt{4}",
        "2^3",
        "1,23",
        "12,34",
        "1,2345",
        "01,234",
        "1,234{,}567",
        "1 000",
        "1_000",
        "0x1A",
        "inf",
        "nan",
        "\u0664\u0662",  # Arabic-Indic 42: int() reads it, math_verify does not
        "\\boxed{1}\\boxed{2}",
        "\\boxed{\\boxed{1}}",
        "\\boxed{$42$}",
        "\\boxed {42}",
        "$$42$$",
        "$\n42\n$",  # math_verify reads inline math on one line only
        "\\(\n42\n\\)",
        "\\[42\\]",
        "$42",
        "42$",
        "\\boxed{42",
        "1" * 5000,  # over Python's int-from-string limit
    ],
)
def test_plain_number_refuses(text: str) -> None:
    assert plain_number(text) is None


_WRAPPERS = ["{}", "${}$", "\\({}\\)", "\\boxed{{{}}}", "$\\boxed{{{}}}$", "\\(\\boxed{{{}}}\\)"]


@given(n=st.integers(-(10**30), 10**30), wrapper=st.sampled_from(_WRAPPERS), sep=st.sampled_from(["", ",", "{,}"]))
def test_property_integers_read_back(n: int, wrapper: str, sep: str) -> None:
    text = _thousands(n, sep) if sep else str(n)
    assert plain_number(wrapper.format(text)) == n


@given(
    v=st.fractions(max_denominator=10**6) | st.builds(Fraction, st.integers(-(10**12), 10**12), st.integers(1, 10**6)),
    form=st.sampled_from(["{n}/{d}", "\\frac{{{n}}}{{{d}}}", "\\dfrac{{{n}}}{{{d}}}", "\\tfrac{{{n}}}{{{d}}}"]),
    wrapper=st.sampled_from(_WRAPPERS),
)
def test_property_fractions_read_back(v: Fraction, form: str, wrapper: str) -> None:
    sign = "-" if v < 0 else ""
    text = sign + form.format(n=abs(v.numerator), d=v.denominator)
    assert plain_number(wrapper.format(text)) == v


@given(m=st.integers(-(10**20), 10**20), places=st.integers(0, 12), wrapper=st.sampled_from(_WRAPPERS))
def test_property_decimals_read_back_exactly(m: int, places: int, wrapper: str) -> None:
    # Written with every place, trailing zeros included: 1.50, not 1.5.
    whole, part = divmod(abs(m), 10**places)
    text = f"{'-' if m < 0 else ''}{whole}" + (f".{part:0{places}d}" if places else "")
    assert plain_number(wrapper.format(text)) == Fraction(m, 10**places)
