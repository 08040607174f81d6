"""Tests for :func:`proctor.server.curriculum.loader.load_curriculum`: files, graders, hashing."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from proctor.server.curriculum.loader import Curriculum, Stage, load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import BUILTIN_GRADERS
from proctor.server.grading.registry import load_callable
from proctor.server.sources.arithmetic import ArithmeticSource
from proctor.server.sources.files import FileSource
from proctor.server.spec import AdvanceGate, CurriculumError

WriteCurriculum = Callable[..., Path]  # the conftest fixture's type

ROWS = [
    {"question": "One plus one?", "answer": "2", "topic": "add"},
    {"question": "Two times three?", "answer": "6", "topic": "mul"},
    {"question": "Ten minus four?", "answer": "6", "topic": "sub"},
]


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def doc(**source: Any) -> dict[str, Any]:
    """One file source ``words`` (override its fields with keyword arguments) and one arithmetic source."""
    words = {"path": "words.jsonl", "prompt_field": "question", "graders": ["numeric"], **source}
    return {
        "name": "demo",
        "seed": 7,
        "sources": {"add": {"kind": "arithmetic", "graders": ["numeric"]}, "words": words},
        "stages": [
            {
                "name": "one",
                "until_step": 10,
                "mix": [{"source": "add", "weight": 1}, {"source": "words", "weight": 3}],
            },
            {"name": "two", "until_step": 30, "mix": [{"source": "words"}], "replay": 0.5},
        ],
    }


def problems_of(path: Path, **kw: Any) -> list[tuple[str, str]]:
    with pytest.raises(CurriculumError) as exc:
        load_curriculum(path, **kw)
    assert exc.value.file == str(path)
    assert str(exc.value).startswith(f"invalid curriculum {path}:\n  ")
    return exc.value.problems


# --- a good curriculum ------------------------------------------------------------------------------------


def test_loads_a_curriculum(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    cur = load_curriculum(path)
    assert isinstance(cur, Curriculum)
    assert (cur.name, cur.seed, cur.path, cur.total_iterations) == ("demo", 7, path.resolve(), 30)
    assert cur.stages == (
        Stage(0, "one", 10, (("add", 0.25), ("words", 0.75)), 0.0, None),
        Stage(1, "two", 30, (("words", 1.0),), 0.5, None),
    )
    assert isinstance(cur.sources["add"], ArithmeticSource)
    words = cur.sources["words"]
    assert isinstance(words, FileSource)
    assert words.size == 3
    assert [words.record(k).prompt for k in range(3)] == [r["question"] for r in ROWS]
    assert [words.record(k).answer for k in range(3)] == ["2", "6", "6"]
    assert set(cur.graders) == {"add", "words"}
    assert [g.ref for g in cur.graders["words"].local] == ["builtin:numeric"]
    assert re.fullmatch(r"[0-9a-f]{16}", cur.hash)


def test_stages_carry_their_gate(write_curriculum: WriteCurriculum) -> None:
    d = doc()
    d["stages"][0]["advance"] = {"threshold": 0.7, "window": 8, "min_steps": 2}
    cur = load_curriculum(write_curriculum(d, {"words.jsonl": jsonl(ROWS)}))
    assert cur.stages[0].advance == AdvanceGate(threshold=0.7, window=8, min_steps=2)
    assert cur.stages[1].advance is None


def test_data_path_is_relative_to_the_curriculum_not_the_cwd(
    write_curriculum: WriteCurriculum, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {"data/words.jsonl": jsonl(ROWS), "sub/data/words.jsonl": jsonl(ROWS[:1])}
    path = write_curriculum(doc(path="data/words.jsonl"), files, name="sub/c.yaml")
    monkeypatch.chdir(tmp_path)
    cur = load_curriculum(path)
    assert cur.sources["words"].size == 1


# --- data problems ----------------------------------------------------------------------------------------


def test_missing_data_file(write_curriculum: WriteCurriculum, tmp_path: Path) -> None:
    path = write_curriculum(doc())
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.path"
    assert msg == f"cannot read {(tmp_path / 'words.jsonl').resolve()}: No such file or directory"


def test_jsonl_line_that_is_not_json_is_named_by_line_number(write_curriculum: WriteCurriculum) -> None:
    text = jsonl(ROWS[:1]) + "\n" + '{"question": "broken", "answer": \n' + jsonl(ROWS[1:])
    path = write_curriculum(doc(), {"words.jsonl": text})
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.path"
    assert msg.startswith("line 3 is not valid JSON: ")


def test_jsonl_line_that_is_not_an_object(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS[:2]) + '["question", "answer"]\n'})
    assert problems_of(path) == [("sources.words.path", "line 3 is a JSON list, not an object")]


@pytest.mark.parametrize(
    "bad",
    [
        {"answer": "3"},
        {"question": "", "answer": "3"},
        {"question": None, "answer": "3"},
        {"question": 5, "answer": "3"},
    ],
    ids=["missing", "empty", "null", "not-text"],
)
def test_record_without_a_prompt(write_curriculum: WriteCurriculum, bad: dict[str, Any]) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl([ROWS[0], bad, ROWS[1]])})
    assert problems_of(path) == [
        ("sources.words.prompt_field", "words.jsonl record 1 has no non-empty text field 'question'")
    ]


@pytest.mark.parametrize("bad", [{"question": "q?"}, {"question": "q?", "answer": None}], ids=["missing", "null"])
def test_record_without_an_answer_says_how_to_opt_out(write_curriculum: WriteCurriculum, bad: dict[str, Any]) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl([*ROWS, bad])})
    assert problems_of(path) == [
        (
            "sources.words.answer_field",
            "words.jsonl record 3 has no field 'answer'; set answer_field: null if this source has no reference answers",
        )
    ]


def test_answer_field_null_allows_records_without_answers(write_curriculum: WriteCurriculum) -> None:
    rows = [{"question": "Say hi."}, {"question": "Say bye.", "answer": "bye"}]
    path = write_curriculum(doc(answer_field=None, graders=["think_format"]), {"words.jsonl": jsonl(rows)})
    words = load_curriculum(path).sources["words"]
    assert [words.record(0).answer, words.record(1).answer] == [None, None]
    assert words.record(1).metadata == {"answer": "bye"}


def test_problems_of_several_sources_are_all_reported(write_curriculum: WriteCurriculum) -> None:
    d = doc()
    d["sources"]["more"] = {"path": "more.jsonl", "graders": ["nope"]}
    d["stages"][1]["mix"].append({"source": "more"})
    path = write_curriculum(d, {"more.jsonl": jsonl([{"prompt": "p", "answer": "a"}])})
    found = problems_of(path)
    assert [where for where, _ in found] == ["sources.words.path", "sources.more.graders[0].name"]


# --- graders ----------------------------------------------------------------------------------------------


def test_unknown_grader_name(write_curriculum: WriteCurriculum) -> None:
    d = doc(graders=["numeric", "nmeric"])
    d["graders"] = {"judge": {"python": "json:dumps"}}
    path = write_curriculum(d, {"words.jsonl": jsonl(ROWS)})
    known = ", ".join([*sorted(BUILTIN_GRADERS), "judge"])
    assert problems_of(path) == [
        (
            "sources.words.graders[1].name",
            f"unknown grader 'nmeric'; use a built-in one or declare it under `graders` ({known})",
        )
    ]


def test_unknown_grader_param_lists_the_accepted_ones(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(
        doc(graders=["think_format", {"name": "numeric", "params": {"tol": 0.1}}]), {"words.jsonl": jsonl(ROWS)}
    )
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.graders[1].params"
    assert msg.startswith("grader 'numeric': ")
    assert "'tol'" in msg
    assert msg.endswith("(accepted params: rel_tol, abs_tol)")


def test_missing_required_grader_param(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(graders=["numeric", "length_cap"]), {"words.jsonl": jsonl(ROWS)})
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.graders[1].params"
    assert "max_tokens" in msg
    assert msg.endswith("(accepted params: max_tokens, soft_margin)")


MY_GRADERS = """
def fn(sample, *, bonus=0.0, scale=1.0):
    return scale * (float(sample.response.strip() == sample.answer) + bonus)
"""


def test_custom_python_grader_relative_to_the_curriculum(
    write_curriculum: WriteCurriculum, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = doc(graders=[{"name": "mine", "params": {"scale": 0.5}}])
    d["graders"] = {"mine": {"python": "./my_graders.py:fn", "params": {"bonus": 1.0, "scale": 2.0}}}
    path = write_curriculum(d, {"conf/words.jsonl": jsonl(ROWS), "conf/my_graders.py": MY_GRADERS}, name="conf/c.yaml")
    monkeypatch.chdir(tmp_path)  # a path relative to the cwd would miss conf/
    cur = load_curriculum(path)
    [grader] = cur.graders["words"].local
    assert grader.ref == f"{(tmp_path / 'conf' / 'my_graders.py').resolve()}:fn"
    assert dict(grader.params) == {"bonus": 1.0, "scale": 0.5}  # the use's params override the defaults
    assert (grader.key, grader.weight, grader.multiplicative) == ("mine", 1.0, False)
    score = load_callable(grader.ref)(
        GradeInput(prompt="q", completion="<think>x</think>2", answer="2"), **grader.params
    )
    assert score == 1.0
    assert cur.graders["words"].remote == ()


def test_missing_custom_python_grader_file(write_curriculum: WriteCurriculum, tmp_path: Path) -> None:
    d = doc(graders=["numeric", "mine"])
    d["graders"] = {"mine": {"python": "./nope.py:fn"}}
    path = write_curriculum(d, {"words.jsonl": jsonl(ROWS)})
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.graders[1].name"
    assert msg.startswith(f"cannot import grader 'mine' from '{(tmp_path / 'nope.py').resolve()}:fn': ")


def test_missing_function_in_custom_grader_file(write_curriculum: WriteCurriculum) -> None:
    d = doc(graders=["mine"])
    d["graders"] = {"mine": {"python": "./my_graders.py:missing"}}
    path = write_curriculum(d, {"words.jsonl": jsonl(ROWS), "my_graders.py": MY_GRADERS})
    [(where, msg)] = problems_of(path)
    assert where == "sources.words.graders[0].name"
    assert msg.startswith("cannot import grader 'mine' from ")
    assert "missing" in msg


def test_missing_custom_grader_module(write_curriculum: WriteCurriculum) -> None:
    d = doc(graders=["mine"])
    d["graders"] = {"mine": {"python": "no_such_module_xyz.graders:fn"}}
    path = write_curriculum(d, {"words.jsonl": jsonl(ROWS)})
    assert problems_of(path) == [
        (
            "sources.words.graders[0].name",
            "cannot import grader 'mine' from 'no_such_module_xyz.graders:fn': No module named 'no_such_module_xyz'",
        )
    ]


def test_remote_grader_is_resolved_without_importing_anything(write_curriculum: WriteCurriculum) -> None:
    d = doc(graders=["numeric", {"name": "judge", "weight": 2, "params": {"rubric": "b"}}])
    d["graders"] = {"judge": {"url": "http://judge.local/grade", "params": {"rubric": "a", "n": 1}, "timeout_s": 3}}
    cur = load_curriculum(write_curriculum(d, {"words.jsonl": jsonl(ROWS)}))
    graders = cur.graders["words"]
    [remote] = graders.remote
    assert (remote.key, remote.url, remote.timeout_s, remote.weight) == ("judge", "http://judge.local/grade", 3.0, 2.0)
    assert dict(remote.params) == {"rubric": "b", "n": 1}
    assert [g.key for g in graders.local] == ["numeric"]
    assert graders.names == ("numeric", "judge")


# --- the file itself --------------------------------------------------------------------------------------


def test_invalid_yaml(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum("name: demo\nsources: {add: [\n")
    [(where, msg)] = problems_of(path)
    assert where == ""
    assert msg.startswith("not valid YAML: ")


def test_missing_curriculum_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    assert problems_of(path) == [("", "cannot read the file: No such file or directory")]


def test_empty_curriculum_file(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum("")
    assert problems_of(path) == [("", "the file must hold a mapping (name, sources, stages, …)")]


def test_spec_errors_name_the_file(write_curriculum: WriteCurriculum) -> None:
    d = doc()
    d["stages"][1]["mix"][0]["source"] = "gsm9k"
    path = write_curriculum(d, {"words.jsonl": jsonl(ROWS)})
    assert problems_of(path) == [("stages[1].mix[0].source", "unknown source 'gsm9k' (known: add, words)")]


# --- hash and versions ------------------------------------------------------------------------------------


def test_hash_is_stable(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    first = load_curriculum(path)
    assert load_curriculum(path).hash == first.hash
    # Rewriting the same content (even as differently formatted YAML) keeps it.
    path.write_text(json.dumps(doc()), encoding="utf-8")
    assert load_curriculum(path).hash == first.hash


def test_hash_changes_when_a_data_file_changes(write_curriculum: WriteCurriculum, tmp_path: Path) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    before = load_curriculum(path)
    (tmp_path / "words.jsonl").write_text(jsonl([*ROWS[:2], {**ROWS[2], "answer": "7"}]), encoding="utf-8")
    after = load_curriculum(path)
    assert after.hash != before.hash
    assert after.sources["words"].version != before.sources["words"].version
    assert after.sources["add"].version == before.sources["add"].version


def test_hash_changes_with_the_seed_in_the_file(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    before = load_curriculum(path)
    write_curriculum({**doc(), "seed": 8})
    after = load_curriculum(path)
    assert (before.seed, after.seed) == (7, 8)
    assert after.hash != before.hash
    assert after.sources["add"].version != before.sources["add"].version


def test_seed_override(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    plain = load_curriculum(path)
    same = load_curriculum(path, seed=7)
    other = load_curriculum(path, seed=8)
    assert same.hash == plain.hash
    assert (other.seed, other.spec.seed) == (8, 8)
    assert other.hash != plain.hash
    assert other.sources["add"].version != plain.sources["add"].version
    prompts = [[c.sources["add"].record(k).prompt for k in range(20)] for c in (plain, other)]
    assert prompts[0] != prompts[1]
    # The override changes the same things as writing that seed into the file.
    write_curriculum({**doc(), "seed": 8})
    assert load_curriculum(path).hash == other.hash


def test_hash_changes_with_the_spec(write_curriculum: WriteCurriculum) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    before = load_curriculum(path).hash
    d = doc()
    d["stages"][1]["until_step"] = 31
    write_curriculum(d)
    assert load_curriculum(path).hash != before


def test_file_source_version_follows_the_file(write_curriculum: WriteCurriculum, tmp_path: Path) -> None:
    path = write_curriculum(doc(), {"words.jsonl": jsonl(ROWS)})
    v1 = load_curriculum(path).sources["words"].version
    assert load_curriculum(path).sources["words"].version == v1
    (tmp_path / "words.jsonl").write_text(jsonl(ROWS) + "\n", encoding="utf-8")  # a byte changed, rows did not
    v2 = load_curriculum(path).sources["words"].version
    assert v2 != v1
    (tmp_path / "words.jsonl").write_text(jsonl(ROWS), encoding="utf-8")
    assert load_curriculum(path).sources["words"].version == v1


# --- CSV and Parquet --------------------------------------------------------------------------------------


def csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "encode"),
    [("words.csv", csv_bytes), ("words.parquet", parquet_bytes)],
    ids=["csv", "parquet"],
)
def test_csv_and_parquet_load_the_same_records_as_jsonl(
    write_curriculum: WriteCurriculum, name: str, encode: Any
) -> None:
    rows = [*ROWS, {"question": 'Quote "this", then a comma, please', "answer": "x, y", "topic": "odd\nline"}]
    as_jsonl = load_curriculum(write_curriculum(doc(), {"words.jsonl": jsonl(rows)}, name="a.yaml"))
    other = load_curriculum(write_curriculum(doc(path=name), {name: encode(rows)}, name="b.yaml"))
    src_j, src_o = as_jsonl.sources["words"], other.sources["words"]
    assert src_o.kind == name.rsplit(".", 1)[1]
    assert src_o.size == src_j.size == len(rows)
    assert [src_o.record(k) for k in range(len(rows))] == [src_j.record(k) for k in range(len(rows))]
    assert src_o.version != src_j.version


def test_a_source_difficulty_stage_needs_a_difficulty_from_every_source(write_curriculum: WriteCurriculum) -> None:
    """An arithmetic source derives its difficulty from its knobs; a reasoning-gym dataset without levels of
    difficulty derives none, and the stage that would read it is refused at load, not at the first /sample."""
    target = {"kind": "target_difficulty", "params": {"difficulty": "source"}}
    sources = {
        "sums": {"kind": "arithmetic", "size": 100, "graders": ["numeric"]},
        "gsm": {"kind": "reasoning_gym", "dataset": "gsm_symbolic", "size": 10, "graders": ["reasoning_gym"]},
    }
    stage = {"name": "only", "until_step": 10, "mix": [{"source": "sums"}], "sampler": target}
    cur = load_curriculum(write_curriculum({"name": "t", "sources": sources, "stages": [stage]}))
    assert cur.sources["sums"].source_difficulty() is not None
    stage["mix"] = [{"source": "sums"}, {"source": "gsm"}]
    with pytest.raises(CurriculumError) as exc:
        load_curriculum(write_curriculum({"name": "t", "sources": sources, "stages": [stage]}))
    assert exc.value.problems == [
        (
            "stages[0].sampler.params.difficulty",
            "`source` reads each source's difficulty, and sources.gsm derives none from its knobs: "
            "give it `difficulty: <number>`",
        )
    ]
    sources["gsm"]["difficulty"] = 0.7
    assert load_curriculum(write_curriculum({"name": "t", "sources": sources, "stages": [stage]})).name == "t"
