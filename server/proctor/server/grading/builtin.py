"""The built-in graders, by the name a curriculum uses for them: :data:`BUILTIN_GRADERS`.

Answer graders (``exact_match``, ``numeric``, ``math``, ``regex``, ``json_valid``, ``json_schema``) look
only at :attr:`GradeInput.response`, the text after a leading ``<think>…</think>`` block; ``think_format``
checks that block itself and ``length_cap`` the reported token count. A wrong completion scores 0.0; a
grader that cannot score at all (bad params, no reference answer, no token count) raises ``ValueError``
saying what to fix.

``reasoning_gym`` scores the answer inside ``<answer>…</answer>`` with the scorer of the reasoning-gym dataset
the record came from (the optional ``reasoning-gym`` extra); ``reasoning_core`` likewise, with the scorer of the
reasoning-core task the record came from (the optional ``reasoning-core`` extra).

``math`` reads a reference and a response that are both plain numbers (``42``, ``3/4``, ``\\boxed{0.5}``, see
:mod:`proctor.server.grading.numbers`) with exact arithmetic, and hands everything else to ``math_verify``,
parsing each reference once per process. ``math_verify``, ``jsonschema``, ``reasoning_gym`` and ``reasoning_core``
are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import importlib
import json
import re
import signal
import threading
from collections.abc import Callable, Mapping
from fractions import Fraction
from functools import lru_cache
from math import ceil, isclose
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from proctor.server.grading.base import GradeInput, GraderFn
from proctor.server.grading.code import code
from proctor.server.grading.numbers import plain_number

if TYPE_CHECKING:
    from jsonschema.protocols import Validator
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

__all__ = [
    "BUILTIN_GRADERS",
    "FAST_VERDICTS",
    "PREPARE",
    "REASONING_CORE_INSTALL",
    "REASONING_CORE_METADATA",
    "REASONING_GYM_INSTALL",
    "REASONING_GYM_METADATA",
    "exact_match",
    "import_reasoning_core",
    "import_reasoning_gym",
    "json_schema",
    "json_valid",
    "length_cap",
    "math",
    "numeric",
    "reasoning_core",
    "reasoning_gym",
    "regex",
    "think_format",
]

# The metadata key under which a reasoning_gym source records its dataset and config, so that the grader scores
# with the dataset as configured (some scorers read their config) and not with the dataset's defaults.
REASONING_GYM_METADATA = "reasoning_gym"
REASONING_GYM_INSTALL = "pip install 'proctor[reasoning-gym]'"
# Likewise for a reasoning_core source: its task, level and config.
REASONING_CORE_METADATA = "reasoning_core"
REASONING_CORE_INSTALL = "pip install 'proctor[reasoning-core]'"

# ASCII only in the look-behind: "x2" is a name, not a number, but "答案是42" must still give 42.
_UNSIGNED = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?"
_NUMBER = re.compile(rf"(?<![A-Za-z0-9_.])(?P<num>[-+\u2212]?(?:{_UNSIGNED}))(?:/(?P<den>{_UNSIGNED}))?(?![0-9])")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED = re.compile(r"\\boxed\s*\{")
_FENCE = re.compile(r"```(?:json\b)?(.*?)```", re.DOTALL | re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")
_THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
# math_verify reads LaTeX only inside a delimiter: a bare reference like "x^2+1" would parse to nothing.
_LATEX_DELIMITED = re.compile(r"\\boxed|\$|\\\(|\\\[")
# Outside a LaTeX delimiter math_verify reads a response with its expression regexes, which misread some plain
# numbers: "+3", "\u22123", "-042", "-.5" and a bare "\dfrac{1}{2}" or "\tfrac{1}{2}" give no answer at all;
# "1{,}234" reads as 1, "03/4" and "3/04" as 3. Inside $...$, \(...\) or \boxed{} (and in a reference, which is
# always delimited) LaTeX parsing reads all of these right. So a bare response takes the fast path only in
# the forms below, and only because math_verify was checked to read each of them as plain arithmetic does.
_BARE_AS_MATH_VERIFY_READS_IT = re.compile(
    r"""
    -?\\frac\{-?[0-9]+\}\{-?[0-9]+\}
  | -?(?:0|[1-9][0-9]*)/[1-9][0-9]*
  | -?[1-9][0-9]{0,2}(?:,[0-9]{3})+(?:\.[0-9]+)?
  | [0-9]+(?:\.[0-9]+)?
  | \.[0-9]+
  | -(?:0|[1-9][0-9]*)(?:\.[0-9]+)?
    """,
    re.VERBOSE,
)
# With a decimal on either side math_verify compares rounded to 6 places (so 1/3 == 0.3333333), in sympy
# Floats of 15 significant digits (so two equal 18-digit decimals can differ). Plain arithmetic decides only
# far from both: equal values written in at most 15 digits, or values further apart than either effect.
_FLOAT_DIGITS = 15
_APART_ABS = Fraction(1, 10**5)
_APART_REL = Fraction(1, 10**12)


def _need_answer(grader: str, sample: GradeInput) -> str:
    if sample.answer is None:
        raise ValueError(
            f"{grader} needs a reference answer, but the record has none: "
            "point the source's answer_field at the field that holds it, or use a grader that needs none"
        )
    return sample.answer


def _to_float(text: str) -> float:
    return float(text.replace(",", "").replace("\u2212", "-"))


def _match_value(m: re.Match[str]) -> float | None:
    value = _to_float(m["num"])
    if m["den"] is None:
        return value
    den = _to_float(m["den"])
    return None if den == 0 else value / den


def _latex_to_plain(text: str) -> str:
    # "1{,}234" and "\frac{3}{4}" are how LaTeX writes numbers this grader already reads as "1,234" and "3/4".
    return _FRAC.sub(r"\1/\2", text.replace("{,}", ","))


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : i]
    return text[starts[-1] :]


def _completion_number(response: str) -> float | None:
    boxed = _last_boxed(response)
    text = _latex_to_plain(response if boxed is None else boxed)
    matches = list(_NUMBER.finditer(text))
    return _match_value(matches[-1]) if matches else None


_NO_JSON = object()


def _load_json(response: str, allow_fence: bool) -> Any:
    fenced = [m.group(1) for m in _FENCE.finditer(response)] if allow_fence else []
    for text in [response, *fenced]:
        try:
            return json.loads(text)
        except ValueError:
            continue
    return _NO_JSON


def _tolerance(name: str, value: Any) -> float:
    # YAML 1.1 reads "1e-6" as a string, so a tolerance written that way would otherwise fail obscurely.
    try:
        tol = float(value)
    except (TypeError, ValueError):
        tol = -1.0
    if not tol >= 0:
        raise ValueError(f"numeric: {name} must be a number >= 0, got {value!r}")
    return tol


def exact_match(sample: GradeInput, /, *, case_sensitive: bool = False, normalize_whitespace: bool = True) -> float:
    """1.0 if the response equals the answer after stripping; ``case_sensitive``, ``normalize_whitespace``."""
    answer = _need_answer("exact_match", sample)
    got, want = sample.response.strip(), answer.strip()
    if normalize_whitespace:
        got, want = _WHITESPACE.sub(" ", got), _WHITESPACE.sub(" ", want)
    if not case_sensitive:
        got, want = got.casefold(), want.casefold()
    return 1.0 if got == want else 0.0


def numeric(sample: GradeInput, /, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 if the last number (of the last ``\\boxed{}`` if any) ≈ the answer; ``rel_tol``, ``abs_tol``."""
    answer = _need_answer("numeric", sample)
    rel, abs_ = _tolerance("rel_tol", rel_tol), _tolerance("abs_tol", abs_tol)
    m = _NUMBER.fullmatch(_latex_to_plain(answer.strip()))
    want = None if m is None else _match_value(m)
    if want is None:
        raise ValueError(
            f"numeric: the reference answer {answer!r} is not a number; it must be a plain number "
            "such as 42, -3.5, 1,234, 1e-3 or 3/4 (use exact_match or math for other answers)"
        )
    got = _completion_number(sample.response)
    return 1.0 if got is not None and isclose(got, want, rel_tol=rel, abs_tol=abs_) else 0.0


def _math_verify_timeout(timeout_s: float) -> int | None:
    # math_verify times out with signal.alarm: off the main thread that raises, and on it the alarm(0) it
    # ends with cancels any timer the caller armed. In both cases the caller's own timeout bounds the work.
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return ceil(timeout_s)


@lru_cache(maxsize=1)
def _extraction_configs() -> tuple[LatexExtractionConfig, ExprExtractionConfig]:
    """The math_verify extraction configs ``math`` parses the reference and the response with."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # Both are math_verify's defaults, spelled out because they decide what counts as an answer.
    # The reference always reaches math_verify inside a LaTeX delimiter (a bare one is wrapped in \boxed{}), so
    # LaTeX extraction reads it; expression extraction stays second for references that mix LaTeX with plain
    # text ("$x$ = 5" gives 5, not x), and reads a plain-text reference as math_verify does by default.
    # For the response, LaTeX extraction catches \boxed{} (tried before all but a "final answer is" phrase),
    # $...$ and \frac; expression extraction catches a bare "42", "3/4" or "x = 19", which a LaTeX-only setup
    # would score 0. math_verify tries the patterns of both by priority and position, so the
    # order only breaks exact ties, in favour of the LaTeX reading. One pair for both sides, too: math_verify
    # keeps only the last config's compiled regexes, so two different pairs would recompile them every call.
    return LatexExtractionConfig(), ExprExtractionConfig()


class _UnparsedReference(Exception):
    pass


@lru_cache(maxsize=4096)
def _parsed_reference(answer: str, timeout: int | None) -> tuple[Any, ...]:
    from math_verify import parse

    gold = parse(
        answer if _LATEX_DELIMITED.search(answer) else f"\\boxed{{{answer}}}",
        extraction_config=list(_extraction_configs()),
        parsing_timeout=timeout,
    )
    if not gold:
        # Raised, not returned, so the cache keeps no failure: a parse that only timed out is tried again.
        raise _UnparsedReference
    return tuple(gold)


@lru_cache(maxsize=4096)
def _reference_number(answer: str) -> Fraction | None:
    return plain_number(answer)


def _digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


def _plain_verdict(answer: str, response: str) -> float | None:
    """The verdict math_verify would give, where both sides are plain numbers it reads as such; else ``None``."""
    want = _reference_number(answer)
    if want is None:
        return None
    if _LATEX_DELIMITED.search(response) is None and not _BARE_AS_MATH_VERIFY_READS_IT.fullmatch(response.strip()):
        return None
    got = plain_number(response)
    if got is None:
        return None
    if "." not in answer and "." not in response:
        return 1.0 if got == want else 0.0
    if got == want:
        return 1.0 if max(_digits(answer), _digits(response)) <= _FLOAT_DIGITS else None
    if abs(got - want) > _APART_ABS + _APART_REL * max(abs(got), abs(want)):
        return 0.0
    return None


def math(sample: GradeInput, /, *, timeout_s: float = 5) -> float:
    """1.0 if ``math_verify`` finds the response equivalent to the answer; ``timeout_s`` per parse/compare."""
    answer = _need_answer("math", sample)
    if not timeout_s > 0:
        raise ValueError(f"math: timeout_s must be > 0, got {timeout_s!r}")
    response = sample.response
    verdict = _plain_verdict(answer, response)
    if verdict is not None:
        return verdict

    from math_verify import parse, verify

    timeout = _math_verify_timeout(timeout_s)
    try:
        gold = _parsed_reference(answer, timeout)
    except _UnparsedReference:
        raise ValueError(
            f"math: could not parse the reference answer {answer!r} as math (or it took over {timeout_s}s); "
            "write it as LaTeX, e.g. \\frac{1}{2}, or use exact_match for non-math answers"
        ) from None
    pred = parse(response, extraction_config=list(_extraction_configs()), parsing_timeout=timeout)
    # verify takes a list, not a tuple, as the set of a side's readings.
    return 1.0 if pred and verify(list(gold), pred, timeout_seconds=timeout) else 0.0


def regex(
    sample: GradeInput,
    /,
    *,
    pattern: str | None = None,
    from_answer: bool = False,
    mode: Literal["search", "fullmatch"] = "search",
    ignore_case: bool = False,
) -> float:
    """1.0 if the response matches ``pattern`` (or the answer, ``from_answer``); ``mode``, ``ignore_case``."""
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"regex: mode must be 'search' or 'fullmatch', got {mode!r}")
    if from_answer:
        if pattern is not None:
            raise ValueError("regex: give either pattern or from_answer: true, not both")
        pattern = _need_answer("regex (from_answer)", sample)
    elif pattern is None:
        raise ValueError(
            "regex needs a pattern: set params: {pattern: ...}, "
            "or from_answer: true to use the record's answer as the pattern"
        )
    try:
        compiled = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as e:
        raise ValueError(f"regex: invalid pattern {pattern!r}: {e}") from None
    match = compiled.search if mode == "search" else compiled.fullmatch
    return 1.0 if match(sample.response) else 0.0


def think_format(sample: GradeInput, /, *, require_answer: bool = True) -> float:
    """1.0 if the completion opens with one ``<think>…</think>`` block and an answer (``require_answer``)."""
    m = _THINK_BLOCK.match(sample.completion)
    if m is None:
        return 0.0
    reasoning, answer = m.groups()
    if "<think>" in reasoning or "<think>" in answer or "</think>" in answer:
        return 0.0
    return 0.0 if require_answer and not answer.strip() else 1.0


def json_valid(sample: GradeInput, /, *, allow_fence: bool = True) -> float:
    """1.0 if the response (or, ``allow_fence``, a ```json fenced block in it) is valid JSON."""
    return 0.0 if _load_json(sample.response, allow_fence) is _NO_JSON else 1.0


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Validator:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    schema = json.loads(schema_json)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"json_schema: the schema is not a valid JSON Schema (2020-12): {e.message}") from None
    return Draft202012Validator(schema)


def _schema_of(sample: GradeInput, schema: Any, schema_field: str | None) -> Any:
    if schema is not None and schema_field is not None:
        raise ValueError("json_schema: give either schema or schema_field, not both")
    if schema_field is not None:
        if schema_field not in sample.metadata:
            raise ValueError(
                f"json_schema: the record has no metadata field {schema_field!r} to read the schema from; "
                "check schema_field and the source's metadata_fields"
            )
        schema = sample.metadata[schema_field]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"json_schema: metadata field {schema_field!r} is not valid JSON: {e}") from None
    elif schema is None:
        raise ValueError(
            "json_schema needs a schema: set params: {schema: {...}}, "
            "or schema_field to take it from the record's metadata"
        )
    if not isinstance(schema, Mapping | bool):
        raise ValueError(f"json_schema: a schema must be a JSON object or boolean, got {type(schema).__name__}")
    return schema


def json_schema(sample: GradeInput, /, *, schema: Any = None, schema_field: str | None = None) -> float:
    """1.0 if the response's JSON (fenced or not) fits ``schema`` or the one in metadata[``schema_field``]."""
    resolved = _schema_of(sample, schema, schema_field)
    try:
        key = json.dumps(resolved, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema: the schema is not plain JSON data: {e}") from None
    validator = _validator(key)
    instance = _load_json(sample.response, allow_fence=True)
    if instance is _NO_JSON:
        return 0.0
    return 1.0 if validator.is_valid(instance) else 0.0


def length_cap(sample: GradeInput, /, *, max_tokens: int, soft_margin: int = 0) -> float:
    """1.0 up to ``max_tokens`` completion tokens, then linearly down to 0.0 over ``soft_margin`` more."""
    if not max_tokens >= 1:
        raise ValueError(f"length_cap: max_tokens must be >= 1, got {max_tokens!r}")
    if not soft_margin >= 0:
        raise ValueError(f"length_cap: soft_margin must be >= 0, got {soft_margin!r}")
    tokens = sample.completion_tokens
    if tokens is None:
        raise ValueError("length_cap needs completion_tokens: send completion_tokens with each /grade item")
    if tokens <= max_tokens:
        return 1.0
    if tokens >= max_tokens + soft_margin:
        return 0.0
    return 1.0 - (tokens - max_tokens) / soft_margin


def import_reasoning_gym(needed_by: str, module: str = "reasoning_gym") -> Any:
    """Import (a module of) reasoning-gym, or raise an ImportError that says who needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs reasoning-gym, which cannot be imported ({exc}): {REASONING_GYM_INSTALL}"
        ) from None


ScoreAnswer = Callable[[str | None, dict[str, Any]], float]


@lru_cache(maxsize=64)
def _reasoning_gym_scorer(dataset: str, config_json: str | None) -> ScoreAnswer:
    """The ``score_answer`` of a dataset: configured as ``config_json`` says, or with its defaults (``None``)."""
    rg = import_reasoning_gym("the reasoning_gym grader")
    known = rg.factory.DATASETS
    if dataset not in known:
        raise ValueError(
            f"reasoning_gym: the record names the dataset {dataset!r}, which this reasoning-gym does not have; "
            "install the reasoning-gym version the records were made with"
        )
    if config_json is None:
        scorer: ScoreAnswer = rg.get_score_answer_fn(dataset)
    else:
        scorer = rg.create_dataset(dataset, **json.loads(config_json)).score_answer
    return scorer


def _reasoning_gym_entry(sample: GradeInput) -> tuple[ScoreAnswer, dict[str, Any]]:
    metadata = dict(sample.metadata)
    scoring = metadata.pop(REASONING_GYM_METADATA, None)
    if isinstance(scoring, Mapping) and isinstance(scoring.get("dataset"), str):
        dataset: Any = scoring["dataset"]
        config_json: str | None = json.dumps(scoring.get("config") or {}, sort_keys=True)
    else:
        # A file of reasoning-gym entries: its metadata fields, or the entries' own `metadata` object, as one field.
        nested = metadata.get("metadata")
        if "source_dataset" not in metadata and isinstance(nested, Mapping):
            metadata = dict(nested)
        dataset, config_json = metadata.get("source_dataset"), None
    if not isinstance(dataset, str):
        raise ValueError(
            "reasoning_gym grades records of reasoning-gym datasets, and this record's metadata names none "
            "(no source_dataset): use it on reasoning_gym sources, or on files of reasoning-gym entries that keep "
            "their metadata"
        )
    entry = {"question": sample.prompt, "answer": sample.answer, "metadata": metadata}
    return _reasoning_gym_scorer(dataset, config_json), entry


def reasoning_gym(sample: GradeInput, /) -> float:
    """The record's reasoning-gym dataset's own ``score_answer`` of the response's last ``<answer>…</answer>``.

    As reasoning-gym's evaluation does: ``reasoning_gym.utils.extract_answer`` takes the text inside the last
    ``<answer>`` tags (``None`` without any, which most scorers give 0), and the dataset's ``score_answer`` scores
    it against the entry rebuilt from the record (prompt, answer, metadata), partial credit included. Unlike
    reasoning-gym's evaluation it reads only the response, after a leading ``<think>…</think>`` block.
    """
    scorer, entry = _reasoning_gym_entry(sample)
    extract_answer = import_reasoning_gym("the reasoning_gym grader", "reasoning_gym.utils").extract_answer
    return float(scorer(extract_answer(sample.response), entry))


def import_reasoning_core(needed_by: str, module: str = "reasoning_core") -> Any:
    """Import (a module of) reasoning-core, or raise an ImportError that says who needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs reasoning-core, which cannot be imported ({exc}): {REASONING_CORE_INSTALL}"
        ) from None


_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@lru_cache(maxsize=64)
def _reasoning_core_scorer(task: str) -> ScoreAnswer:
    """A task's ``score_answer``; reasoning-core's scorers read the entry only, never the task's config."""
    rc = import_reasoning_core("the reasoning_core grader")
    if task not in rc.DATASETS and task not in rc.DEV_DATASETS:
        raise ValueError(
            f"reasoning_core: the record names the task {task!r}, which this reasoning-core does not have; "
            "install the reasoning-core version the records were made with"
        )
    scorer: ScoreAnswer = rc.get_score_answer_fn(task)
    return scorer


def _reasoning_core_entry(sample: GradeInput) -> tuple[str, Any]:
    metadata = dict(sample.metadata)
    scoring = metadata.pop(REASONING_CORE_METADATA, None)
    task = scoring.get("task") if isinstance(scoring, Mapping) else None
    if task is None:
        # A file of reasoning-core rows: the item's metadata as fields, or as one field `metadata` (an object, or the
        # JSON text reasoning-core's published rows hold). Each item's metadata names its task in `_task`.
        nested = metadata.get("metadata")
        if isinstance(nested, str):
            try:
                nested = json.loads(nested)
            except ValueError:
                nested = None
        if "_task" not in metadata and isinstance(nested, Mapping):
            metadata = dict(nested)
        task = metadata.get("_task")
    if not isinstance(task, str):
        raise ValueError(
            "reasoning_core grades records of reasoning-core tasks, and this record's metadata names none "
            "(no _task): use it on reasoning_core sources, or on files of reasoning-core rows that keep their metadata"
        )
    # Scorers read the entry as reasoning-core's own dispatcher hands a plain row to them: attributes all the way down.
    edict = import_reasoning_core("the reasoning_core grader", "easydict").EasyDict
    return task, edict({"prompt": sample.prompt, "answer": sample.answer, "metadata": metadata, "task": task})


def reasoning_core(sample: GradeInput, /) -> float:
    """The record's reasoning-core task's own ``score_answer`` of the text inside the last ``<answer>…</answer>``.

    reasoning-core's prompts say what the answer is ("The answer is a number.") but not where to write it; its own
    evaluation (``reasoning_core.evaluate_model``) asks, in a system prompt, for the final answer between
    ``<answer>`` and ``</answer>`` tags and scores what is inside them. So does this grader: the text inside the
    response's last ``<answer>…</answer>``, stripped, is scored by the task's ``score_answer`` against the entry
    rebuilt from the record (prompt, answer, metadata), partial credit included. A response without the tags has
    no answer and scores 0.0, so give such a source a system prompt that asks for them. Only the response counts:
    tags inside a leading ``<think>…</think>`` block are not the answer.
    """
    task, entry = _reasoning_core_entry(sample)
    scorer = _reasoning_core_scorer(task)
    answers = _ANSWER_TAGS.findall(sample.response)
    if not answers:
        return 0.0
    return float(scorer(answers[-1].strip(), entry))


def _math_fast(sample: GradeInput, /, *, timeout_s: float = 5) -> float | None:
    if sample.answer is None or not timeout_s > 0:
        return None  # the grader's own error, from a grader process
    return _plain_verdict(sample.answer, sample.response)


def _exact_match_fast(
    sample: GradeInput, /, *, case_sensitive: bool = False, normalize_whitespace: bool = True
) -> float | None:
    if sample.answer is None:
        return None
    return exact_match(sample, case_sensitive=case_sensitive, normalize_whitespace=normalize_whitespace)


# numeric's reading of a completion walks the last \boxed{} character by character: beyond this length the
# walk could hold the event loop for milliseconds, so longer completions go to a grader process.
_NUMERIC_FAST_CHARS = 20_000


def _numeric_fast(sample: GradeInput, /, **params: Any) -> float | None:
    # A missing reference or a bad param raises ValueError or TypeError: the fanout leaves those to a grader
    # process, which says what is wrong.
    return None if len(sample.response) > _NUMERIC_FAST_CHARS else numeric(sample, **params)


FAST_VERDICTS: Mapping[str, Callable[..., float | None]] = MappingProxyType(
    {"math": _math_fast, "exact_match": _exact_match_fast, "numeric": _numeric_fast}
)
"""Built-in graders whose verdict the server may reach in its own process, where it is cheap and bounded: a
few string operations and linear-time regular expressions over a completion of bounded length, exact
arithmetic on numbers of at most 4,300 digits (Python's limit for reading one), and floating-point
comparison. ``fn(sample, **params)`` is the grader's score, or ``None`` where only the grader process can
decide (``math`` handing over to math-verify, a missing reference, a bad parameter, a long completion)."""


def _prepare_math() -> None:
    # Imports math_verify (and sympy) and builds its LaTeX parser, about 0.3 s together here.
    math(GradeInput(prompt="", completion="$x^2 + 1$", answer="$x^2+1$"))  # not a plain number: math-verify reads it


PREPARE: Mapping[str, Callable[[], None]] = MappingProxyType({"math": _prepare_math})
"""What a built-in grader builds on its first call beyond the module's import, done ahead by a grader process
that is about to grade with it (see :func:`proctor.server.grading.registry.prepare_grader`)."""


BUILTIN_GRADERS: Mapping[str, GraderFn] = MappingProxyType(
    {
        fn.__name__: fn
        for fn in (
            exact_match,
            numeric,
            math,
            regex,
            think_format,
            json_valid,
            json_schema,
            length_cap,
            reasoning_gym,
            reasoning_core,
            code,
        )
    }
)
