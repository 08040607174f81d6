"""Tests for the curriculum file format in :mod:`proctor.server.spec`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from proctor.server.spec import (
    NAME_PATTERN,
    ArithmeticSourceSpec,
    CurriculumError,
    FileSourceSpec,
    GraderUse,
    format_loc,
    parse_spec,
)

Doc = dict[str, Any]


def base_doc() -> Doc:
    """A valid two-source, two-stage curriculum that each bad case below breaks in one place."""
    return {
        "name": "demo",
        "seed": 5,
        "sources": {
            "add": {"kind": "arithmetic", "ops": ["+"], "graders": ["numeric"]},
            "words": {"path": "data/words.jsonl", "prompt_field": "question", "graders": ["math"]},
        },
        "stages": [
            {"name": "warmup", "until_step": 10, "mix": [{"source": "add"}], "advance": {"threshold": 0.8}},
            {"name": "mixed", "until_step": 20, "mix": [{"source": "add"}, {"source": "words", "weight": 3}]},
        ],
    }


def edited(edit: Callable[[Doc], object]) -> Doc:
    doc = base_doc()
    edit(doc)
    return doc


def _src(doc: Doc, name: str = "add") -> dict[str, Any]:
    src: dict[str, Any] = doc["sources"][name]
    return src


def _stage(doc: Doc, i: int) -> dict[str, Any]:
    stage: dict[str, Any] = doc["stages"][i]
    return stage


def _rename_source(doc: Doc, old: str, new: str) -> None:
    doc["sources"][new] = doc["sources"].pop(old)
    for stage in doc["stages"]:
        for entry in stage["mix"]:
            if entry["source"] == old:
                entry["source"] = new


_NAME_MSG = f"String should match pattern '{NAME_PATTERN}'"
_ONE_KIND = "give exactly one of `python: module:attr`, `url: http://…` or `judge: {url, model, …}`"

# (id, the broken document, the exact (yaml path, message) problems expected)
BAD_CASES: list[tuple[str, Doc, list[tuple[str, str]]]] = [
    (
        "unknown-source-in-mix",
        edited(lambda d: _stage(d, 1)["mix"].__setitem__(0, {"source": "gsm9k"})),
        [("stages[1].mix[0].source", "unknown source 'gsm9k' (known: add, words)")],
    ),
    (
        "source-twice-in-a-mix",
        edited(lambda d: _stage(d, 1)["mix"].append({"source": "add", "weight": 2})),
        [("stages[1].mix[2].source", "'add' is in this mix twice")],
    ),
    (
        "until-step-equal",
        edited(lambda d: _stage(d, 1).update(until_step=10)),
        [("stages[1].until_step", "must be greater than the previous stage's (10)")],
    ),
    (
        "until-step-decreasing",
        edited(lambda d: _stage(d, 1).update(until_step=4)),
        [("stages[1].until_step", "must be greater than the previous stage's (10)")],
    ),
    (
        "until-step-zero",
        edited(lambda d: _stage(d, 0).update(until_step=0)),
        [("stages[0].until_step", "Input should be greater than 0")],
    ),
    (
        "duplicate-stage-name",
        edited(lambda d: _stage(d, 1).update(name="warmup")),
        [("stages[1].name", "stage 'warmup' is defined twice")],
    ),
    (
        "replay-on-first-stage",
        edited(lambda d: _stage(d, 0).update(replay=0.1)),
        [("stages[0].replay", "the first stage has no earlier stage to replay")],
    ),
    (
        "replay-of-one",
        edited(lambda d: _stage(d, 1).update(replay=1.0)),
        [("stages[1].replay", "Input should be less than 1")],
    ),
    (
        "advance-on-last-stage",
        edited(lambda d: _stage(d, 1).update(advance={"threshold": 0.9})),
        [("stages[1].advance", "the last stage has no next stage to advance to")],
    ),
    (
        "advance-window-zero",
        edited(lambda d: _stage(d, 0)["advance"].update(window=0)),
        [("stages[0].advance.window", "Input should be greater than or equal to 1")],
    ),
    (
        "mix-weight-zero",
        edited(lambda d: _stage(d, 1)["mix"][1].update(weight=0)),
        [("stages[1].mix[1].weight", "Input should be greater than 0")],
    ),
    (
        "empty-mix",
        edited(lambda d: _stage(d, 0).update(mix=[])),
        [("stages[0].mix", "List should have at least 1 item after validation, not 0")],
    ),
    (
        "typo-top-level-key",
        edited(lambda d: d.update(sead=3)),
        [("sead", "Extra inputs are not permitted")],
    ),
    (
        "typo-source-key",
        edited(lambda d: _src(d).update(digitz=[1, 2])),
        [("sources.add.digitz", "Extra inputs are not permitted")],
    ),
    (
        "typo-file-source-key",
        edited(lambda d: _src(d, "words").update(answer_feild="a")),
        [("sources.words.answer_feild", "Extra inputs are not permitted")],
    ),
    (
        "typo-stage-key",
        edited(lambda d: _stage(d, 1).update(untill_step=_stage(d, 1).pop("until_step"))),
        [("stages[1].until_step", "Field required"), ("stages[1].untill_step", "Extra inputs are not permitted")],
    ),
    (
        "typo-mix-key",
        edited(lambda d: _stage(d, 1)["mix"][1].update(wieght=_stage(d, 1)["mix"][1].pop("weight"))),
        [("stages[1].mix[1].wieght", "Extra inputs are not permitted")],
    ),
    (
        "typo-grader-use-key",
        edited(lambda d: _src(d).update(graders=[{"name": "numeric", "wieght": 1}])),
        [("sources.add.graders[0].wieght", "Extra inputs are not permitted")],
    ),
    (
        "missing-stages",
        edited(lambda d: d.pop("stages")),
        [("stages", "Field required")],
    ),
    (
        "no-sources",
        edited(lambda d: d.update(sources={})),
        [("sources", "Dictionary should have at least 1 item after validation, not 0")],
    ),
    (
        "digits-reversed",
        edited(lambda d: _src(d).update(digits=[3, 1])),
        [("sources.add.digits", "must be [min, max] with 1 ≤ min ≤ max ≤ 18, got [3, 1]")],
    ),
    (
        "digits-zero",
        edited(lambda d: _src(d).update(digits=[0, 2])),
        [("sources.add.digits", "must be [min, max] with 1 ≤ min ≤ max ≤ 18, got [0, 2]")],
    ),
    (
        "digits-too-many",
        edited(lambda d: _src(d).update(digits=[1, 19])),
        [("sources.add.digits", "must be [min, max] with 1 ≤ min ≤ max ≤ 18, got [1, 19]")],
    ),
    (
        "operands-one",
        edited(lambda d: _src(d).update(operands=1)),
        [("sources.add.operands", "Input should be greater than or equal to 2")],
    ),
    (
        "unknown-op",
        edited(lambda d: _src(d).update(ops=["/"])),
        [("sources.add.ops[0]", "Input should be '+', '-' or '*'")],
    ),
    (
        "template-without-placeholder",
        edited(lambda d: _src(d).update(template="What is {expr}?")),
        [("sources.add.template", "must contain the placeholder {expression}")],
    ),
    (
        "empty-graders",
        edited(lambda d: _src(d).update(graders=[])),
        [("sources.add.graders", "List should have at least 1 item after validation, not 0")],
    ),
    (
        "duplicate-grader-name",
        edited(lambda d: _src(d).update(graders=["numeric", {"name": "numeric", "params": {"abs_tol": 0.5}}])),
        [("sources.add.graders", "grader 'numeric' is listed twice; give one of them an `id`")],
    ),
    (
        "duplicate-grader-id",
        edited(lambda d: _src(d).update(graders=[{"name": "numeric", "id": "x"}, {"name": "math", "id": "x"}])),
        [("sources.add.graders", "grader 'x' is listed twice; give one of them an `id`")],
    ),
    (
        "id-clashes-with-name",
        edited(lambda d: _src(d).update(graders=["math", {"name": "numeric", "id": "math"}])),
        [("sources.add.graders", "grader 'math' is listed twice; give one of them an `id`")],
    ),
    (
        "all-multiplicative",
        edited(lambda d: _src(d).update(graders=[{"name": "numeric", "multiplicative": True}])),
        [("sources.add.graders", "at least one grader must be additive (multiplicative: false)")],
    ),
    (
        "additive-weights-zero",
        edited(
            lambda d: _src(d).update(
                graders=[{"name": "numeric", "weight": 0}, {"name": "think_format", "multiplicative": True}]
            )
        ),
        [("sources.add.graders", "the additive graders' weights sum to 0; give at least one a positive weight")],
    ),
    (
        "negative-grader-weight",
        edited(lambda d: _src(d).update(graders=[{"name": "numeric", "weight": -1}])),
        [("sources.add.graders[0].weight", "Input should be greater than or equal to 0")],
    ),
    (
        "custom-grader-both",
        edited(lambda d: d.update(graders={"judge": {"python": "pkg.mod:fn", "url": "http://judge"}})),
        [("graders.judge", _ONE_KIND)],
    ),
    (
        "custom-grader-neither",
        edited(lambda d: d.update(graders={"judge": {"params": {"k": 1}}})),
        [("graders.judge", _ONE_KIND)],
    ),
    (
        "custom-grader-python-without-attr",
        edited(lambda d: d.update(graders={"judge": {"python": "pkg.mod"}})),
        [("graders.judge.python", "String should match pattern '^[^:]+:[A-Za-z_][A-Za-z0-9_]*$'")],
    ),
    (
        "custom-grader-url-not-http",
        edited(lambda d: d.update(graders={"judge": {"url": "ftp://judge"}})),
        [("graders.judge.url", "String should match pattern '^https?://'")],
    ),
    (
        "bad-curriculum-name",
        edited(lambda d: d.update(name="my curriculum")),
        [("name", _NAME_MSG)],
    ),
    (
        "bad-stage-name",
        edited(lambda d: _stage(d, 0).update(name="-warmup")),
        [("stages[0].name", _NAME_MSG)],
    ),
    (
        "bad-source-name",
        edited(lambda d: _rename_source(d, "add", "add one")),
        [("sources.add one", f"source names must match {NAME_PATTERN}")],
    ),
    (
        "bad-grader-name",
        edited(lambda d: d.update(graders={"my/judge": {"python": "pkg.mod:fn"}})),
        [("graders.my/judge", f"grader names must match {NAME_PATTERN}")],
    ),
    (
        "unknown-kind",
        edited(lambda d: _src(d).update(kind="sql")),
        [
            (
                "sources.add",
                "Input tag 'sql' found using 'kind' does not match any of the expected tags: "
                "'arithmetic', 'jsonl', 'parquet', 'csv', 'reasoning_gym', 'reasoning_core'",
            )
        ],
    ),
    (
        "path-suffix-says-nothing",
        edited(lambda d: _src(d, "words").update(path="data/words.txt")),
        [("sources.words", "Unable to extract tag using discriminator 'kind'")],
    ),
    (
        "several-problems-at-once",
        edited(
            lambda d: (
                _stage(d, 0).update(replay=0.2),
                _stage(d, 1)["mix"].__setitem__(0, {"source": "gsm9k"}),
                _stage(d, 1).update(advance={"threshold": 0.5}),
            )
        ),
        [
            ("stages[0].replay", "the first stage has no earlier stage to replay"),
            ("stages[1].mix[0].source", "unknown source 'gsm9k' (known: add, words)"),
            ("stages[1].advance", "the last stage has no next stage to advance to"),
        ],
    ),
    (
        "sampler-unknown-kind",
        edited(lambda d: _stage(d, 0).update(sampler={"kind": "greedy"})),
        [
            (
                "stages[0].sampler",
                "Input tag 'greedy' found using 'kind' does not match any of the expected tags: 'uniform', "
                "'learnability', 'skip_zero_variance', 'target_difficulty'",
            )
        ],
    ),
    (
        "sampler-param-typo",
        edited(lambda d: _stage(d, 0).update(sampler={"kind": "learnability", "params": {"explor": 0.1}})),
        [("stages[0].sampler.params.explor", "Extra inputs are not permitted")],
    ),
    (
        "sampler-param-out-of-range",
        edited(lambda d: _stage(d, 0).update(sampler={"kind": "skip_zero_variance", "params": {"max_skip": 1}})),
        [("stages[0].sampler.params.max_skip", "Input should be less than 1")],
    ),
    (
        "sampler-bad-prior",
        edited(lambda d: _stage(d, 0).update(sampler={"kind": "learnability", "params": {"prior": [0, 1]}})),
        [("stages[0].sampler.params.prior", "both Beta prior counts must be positive, got [0.0, 1.0]")],
    ),
    (
        "learning-progress-floors-beyond-a-batch",
        edited(
            lambda d: _stage(d, 1).update(mixing={"kind": "learning_progress", "params": {"floor": 0.6}}),
        ),
        [
            (
                "stages[1].mixing.params.floor",
                "stage 'mixed' serves 2 sources, and a floor of 0.6 each asks for 1.2 of every batch: give a floor "
                "of at most 0.5",
            )
        ],
    ),
    (
        "learning-progress-floors-count-the-replayed-sources",
        edited(
            lambda d: (
                _stage(d, 1)["mix"].pop(),
                _stage(d, 1).update(replay=0.1, mixing={"kind": "learning_progress", "params": {"floor": 0.5}}),
                d["sources"].update(more={"kind": "arithmetic", "graders": ["numeric"]}),
                _stage(d, 0)["mix"].append({"source": "more"}),
                _stage(d, 1)["mix"].append({"source": "words"}),
            )
        ),
        [
            (
                "stages[1].mixing.params.floor",
                "stage 'mixed' serves 3 sources, and a floor of 0.5 each asks for 1.5 of every batch: give a floor "
                "of at most 0.3333",
            )
        ],
    ),
    (
        "mixing-unknown-kind",
        edited(lambda d: _stage(d, 1).update(mixing={"kind": "bandit"})),
        [
            (
                "stages[1].mixing",
                "Input tag 'bandit' found using 'kind' does not match any of the expected tags: 'fixed', "
                "'learning_progress'",
            )
        ],
    ),
    (
        "refill-range-upside-down",
        edited(
            lambda d: _stage(d, 1).update(refill={"kind": "mean_reward_outside", "low": 0.9, "high": 0.1}),
        ),
        [("stages[1].refill", "low (0.9) is above high (0.1): the kept range is [low, high]")],
    ),
    (
        "refill-unknown-kind",
        edited(lambda d: _stage(d, 1).update(refill={"kind": "dapo"})),
        [
            (
                "stages[1].refill",
                "Input tag 'dapo' found using 'kind' does not match any of the expected tags: 'zero_variance', "
                "'mean_reward_outside'",
            )
        ],
    ),
    (
        "refill-too-many-rounds",
        edited(lambda d: _stage(d, 1).update(refill={"kind": "zero_variance", "max_rounds": 17})),
        [("stages[1].refill.max_rounds", "Input should be less than or equal to 16")],
    ),
    (
        "learning-progress-temperature-zero",
        edited(lambda d: _stage(d, 1).update(mixing={"kind": "learning_progress", "params": {"temperature": 0}})),
        [("stages[1].mixing.params.temperature", "Input should be greater than 0")],
    ),
    (
        "adaptive-sampler-on-an-endless-source",
        edited(lambda d: _stage(d, 0).update(sampler={"kind": "learnability"})),
        [
            (
                "stages[0].sampler",
                "learnability chooses among a finite source's records, and sources.add is an endless generator: "
                "give it `size: N` to serve records 0..N-1",
            )
        ],
    ),
    (
        "record-difficulty-without-a-field",
        edited(
            lambda d: _stage(d, 1).update(
                mix=[{"source": "words"}], sampler={"kind": "target_difficulty", "params": {"difficulty": "record"}}
            )
        ),
        [
            (
                "stages[1].sampler.params.difficulty",
                "`record` reads each record's difficulty_field, and sources.words has none; give it "
                "`difficulty_field`, or use `difficulty: source` or `pass_rate`",
            )
        ],
    ),
    (
        "source-difficulty-missing",
        edited(
            lambda d: _stage(d, 1).update(
                mix=[{"source": "words"}], sampler={"kind": "target_difficulty", "params": {"difficulty": "source"}}
            )
        ),
        [
            (
                "stages[1].sampler.params.difficulty",
                "`source` reads each source's difficulty, and sources.words has none: give it `difficulty: <number>`",
            )
        ],
    ),
    (
        "replay-brings-an-endless-source-into-an-adaptive-stage",
        edited(lambda d: _stage(d, 1).update(mix=[{"source": "words"}], replay=0.2, sampler={"kind": "learnability"})),
        [
            (
                "stages[1].sampler",
                "learnability chooses among a finite source's records, and sources.add is an endless generator: "
                "give it `size: N` to serve records 0..N-1",
            )
        ],
    ),
]


def test_a_sampler_defaults_to_uniform_and_reads_its_params() -> None:
    spec = parse_spec(base_doc())
    assert [st.sampler.kind for st in spec.stages] == ["uniform", "uniform"]
    doc = base_doc()
    _src(doc, "add").update(size=100)
    _stage(doc, 1).update(sampler={"kind": "learnability", "params": {"explore": 0.2}})
    _stage(doc, 0).update(sampler={"kind": "skip_zero_variance"})
    spec = parse_spec(doc)
    assert spec.stages[1].sampler.kind == "learnability"
    assert spec.stages[1].sampler.params.model_dump() == {"explore": 0.2, "epoch_mass": 0.5, "prior": (1.0, 1.0)}
    assert spec.stages[0].sampler.params.model_dump() == {"min_streak": 1, "skip_probability": 0.5, "max_skip": 0.9}


def test_the_base_document_is_valid() -> None:
    spec = parse_spec(base_doc())
    assert spec.name == "demo"
    assert list(spec.sources) == ["add", "words"]
    assert [s.name for s in spec.stages] == ["warmup", "mixed"]


@pytest.mark.parametrize(("doc", "problems"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_curriculum_is_reported_with_its_yaml_path(doc: Doc, problems: list[tuple[str, str]]) -> None:
    with pytest.raises(CurriculumError) as exc:
        parse_spec(doc, file="demo.yaml")
    assert exc.value.problems == problems
    assert exc.value.file == "demo.yaml"
    lines = str(exc.value).splitlines()
    assert lines[0] == "invalid curriculum demo.yaml:"
    assert lines[1:] == [f"  {path}: {msg}" for path, msg in problems]


@pytest.mark.parametrize("source_name", ["arithmetic", "csv"])
def test_a_source_named_like_a_kind_keeps_its_name_in_the_yaml_path(source_name: str) -> None:
    doc = edited(lambda d: _rename_source(d, "add", source_name))
    _src(doc, source_name).update(digits=[3, 1])
    with pytest.raises(CurriculumError) as exc:
        parse_spec(doc)
    assert exc.value.problems == [
        (f"sources.{source_name}.digits", "must be [min, max] with 1 ≤ min ≤ max ≤ 18, got [3, 1]")
    ]


def test_unknown_source_message_matches_the_documented_shape() -> None:
    doc = edited(lambda d: _stage(d, 1)["mix"].__setitem__(0, {"source": "gsm9k"}))
    with pytest.raises(CurriculumError, match=r"stages\[1\]\.mix\[0\]\.source: unknown source 'gsm9k' \(known: "):
        parse_spec(doc)


def test_error_without_a_file_has_a_plain_head() -> None:
    with pytest.raises(CurriculumError) as exc:
        parse_spec(edited(lambda d: d.update(sead=1)))
    assert exc.value.file is None
    assert str(exc.value) == "invalid curriculum:\n  sead: Extra inputs are not permitted"


@pytest.mark.parametrize(
    "data", [None, [], ["name", "demo"], "name: demo", 42], ids=["null", "empty-list", "list", "str", "int"]
)
def test_non_mapping_document_is_refused(data: object) -> None:
    with pytest.raises(CurriculumError) as exc:
        parse_spec(data, file="c.yaml")
    assert exc.value.problems == [("", "the file must hold a mapping (name, sources, stages, …)")]
    assert str(exc.value) == "invalid curriculum c.yaml:\n  the file must hold a mapping (name, sources, stages, …)"


def test_grader_string_shorthand_equals_the_mapping_form() -> None:
    short = parse_spec(edited(lambda d: _src(d).update(graders=["numeric", {"name": "think_format", "weight": 0.1}])))
    long = parse_spec(
        edited(lambda d: _src(d).update(graders=[{"name": "numeric"}, {"name": "think_format", "weight": 0.1}]))
    )
    assert short == long
    graders = short.sources["add"].graders
    assert graders[0] == GraderUse(name="numeric")
    assert (graders[0].weight, graders[0].multiplicative, graders[0].params, graders[0].key) == (
        1.0,
        False,
        {},
        "numeric",
    )
    assert (graders[1].name, graders[1].weight) == ("think_format", 0.1)


def test_grader_key_is_the_id_when_given() -> None:
    assert GraderUse(name="numeric", id="strict").key == "strict"
    assert GraderUse(name="numeric").key == "numeric"


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("data/x.jsonl", "jsonl"),
        ("data/x.csv", "csv"),
        ("data/x.parquet", "parquet"),
        ("DATA/X.JSONL", "jsonl"),
        ("a.b/x.v2.csv", "csv"),
    ],
    ids=["jsonl", "csv", "parquet", "upper-case", "dots-in-dirs"],
)
def test_file_kind_is_inferred_from_the_path_suffix(path: str, kind: str) -> None:
    spec = parse_spec(edited(lambda d: _src(d, "words").update(path=path)))
    src = spec.sources["words"]
    assert isinstance(src, FileSourceSpec)
    assert (src.kind, src.path) == (kind, path)


def test_explicit_kind_wins_over_the_suffix() -> None:
    spec = parse_spec(edited(lambda d: _src(d, "words").update(path="data/x.txt", kind="csv")))
    src = spec.sources["words"]
    assert isinstance(src, FileSourceSpec)
    assert src.kind == "csv"


def test_defaults() -> None:
    spec = parse_spec(
        {
            "name": "d",
            "sources": {
                "a": {"kind": "arithmetic", "graders": ["numeric"]},
                "f": {"path": "f.jsonl", "graders": ["math"]},
            },
            "stages": [{"name": "s", "until_step": 1, "mix": [{"source": "a"}]}],
        }
    )
    assert (spec.seed, spec.system_prompt, spec.graders) == (0, None, {})
    a = spec.sources["a"]
    assert isinstance(a, ArithmeticSourceSpec)
    assert (a.ops, a.digits, a.operands, a.allow_negative, a.template, a.on_error) == (
        ["+"],
        (1, 1),
        2,
        False,
        "What is {expression}?",
        0.0,
    )
    f = spec.sources["f"]
    assert isinstance(f, FileSourceSpec)
    assert (f.prompt_field, f.answer_field, f.system_prompt_field, f.metadata_fields) == (
        "prompt",
        "answer",
        None,
        None,
    )
    stage = spec.stages[0]
    assert (stage.mix[0].weight, stage.replay, stage.advance) == (1.0, 0.0, None)


def test_advance_gate_defaults() -> None:
    gate = parse_spec(base_doc()).stages[0].advance
    assert gate is not None
    assert (gate.threshold, gate.window, gate.min_steps) == (0.8, 64, 0)


def test_custom_graders_parse() -> None:
    spec = parse_spec(
        edited(
            lambda d: d.update(
                graders={
                    "judge": {"python": "./graders.py:score", "params": {"strict": True}},
                    "remote": {"url": "https://judge.example/grade", "timeout_s": 5, "headers": {"x-key": "k"}},
                }
            )
        )
    )
    assert spec.graders["judge"].python == "./graders.py:score"
    assert spec.graders["judge"].params == {"strict": True}
    assert spec.graders["remote"].url == "https://judge.example/grade"
    assert (spec.graders["remote"].timeout_s, spec.graders["remote"].headers) == (5.0, {"x-key": "k"})


def test_spec_is_frozen() -> None:
    spec = parse_spec(base_doc())
    with pytest.raises(Exception, match="frozen"):
        spec.name = "other"


def test_parse_does_not_mutate_its_input() -> None:
    doc = base_doc()
    before = copy.deepcopy(doc)
    parse_spec(doc)
    assert doc == before


@pytest.mark.parametrize(
    ("loc", "text"),
    [
        (("stages", 1, "mix", 0, "source"), "stages[1].mix[0].source"),
        (["sources", "add", "graders", 0], "sources.add.graders[0]"),
        ((), ""),
        ((3,), "[3]"),
        (("name",), "name"),
    ],
    ids=["nested", "list", "empty", "index-first", "single"],
)
def test_format_loc(loc: tuple[int | str, ...] | list[int | str], text: str) -> None:
    assert format_loc(loc) == text
