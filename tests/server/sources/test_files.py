"""Tests for the file-backed sources in :mod:`proctor.server.sources.files`."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from proctor.server.sources.files import FileSource, SourceDataError
from proctor.server.sources.registry import build_source
from proctor.server.spec import FileSourceSpec

Rows = list[dict[str, Any]]


def jsonl_bytes(rows: Rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def csv_bytes(rows: Rows) -> bytes:
    out = io.StringIO()
    fields = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def parquet_bytes(rows: Rows, schema: pa.Schema | None = None) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return out.getvalue()


ENCODERS: dict[str, Callable[[Rows], bytes]] = {"jsonl": jsonl_bytes, "csv": csv_bytes, "parquet": parquet_bytes}
KINDS = list(ENCODERS)

ROWS: Rows = [
    {"prompt": "What is 2+2?", "answer": "4", "topic": "add", "level": "1"},
    {"prompt": "Capital of France?", "answer": "Paris", "topic": "geo", "level": "2"},
    {"prompt": "Dites « bonjour », with a, comma", "answer": "bonjour", "topic": "fr\nnewline", "level": "3"},
]


def spec(kind: str, **fields: Any) -> FileSourceSpec:
    return FileSourceSpec.model_validate({"kind": kind, "path": f"x.{kind}", "graders": ["exact_match"], **fields})


def make(tmp_path: Path, kind: str, data: bytes | Rows, **fields: Any) -> FileSource:
    raw = data if isinstance(data, bytes) else ENCODERS[kind](data)
    (tmp_path / f"x.{kind}").write_bytes(raw)
    return FileSource("x", spec(kind, **fields), tmp_path)


def data_error(tmp_path: Path, kind: str, data: bytes | Rows, **fields: Any) -> SourceDataError:
    with pytest.raises(SourceDataError) as exc:
        make(tmp_path, kind, data, **fields)
    return exc.value


# --- reading ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reads_every_record(tmp_path: Path, kind: str) -> None:
    src = make(tmp_path, kind, ROWS)
    assert (src.size, src.kind, src.path) == (3, kind, (tmp_path / f"x.{kind}").resolve())
    for k, row in enumerate(ROWS):
        record = src.record(k)
        assert record.key == k
        assert (record.prompt, record.answer, record.system_prompt) == (row["prompt"], row["answer"], None)
        assert dict(record.metadata) == {"topic": row["topic"], "level": row["level"]}


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_fields_restrict_the_metadata(tmp_path: Path, kind: str) -> None:
    assert dict(make(tmp_path, kind, ROWS, metadata_fields=["level"]).record(1).metadata) == {"level": "2"}
    assert dict(make(tmp_path, kind, ROWS, metadata_fields=[]).record(1).metadata) == {}
    both = make(tmp_path, kind, ROWS, metadata_fields=["answer", "topic"]).record(0).metadata
    assert dict(both) == {"answer": "4", "topic": "add"}


@pytest.mark.parametrize("kind", KINDS)
def test_missing_metadata_field(tmp_path: Path, kind: str) -> None:
    err = data_error(tmp_path, kind, ROWS, metadata_fields=["topic", "nope", "gone"])
    assert (err.field, str(err)) == ("metadata_fields", f"x.{kind} record 0 has no field(s) 'nope', 'gone'")


@pytest.mark.parametrize("kind", KINDS)
def test_other_prompt_and_answer_fields(tmp_path: Path, kind: str) -> None:
    rows = [{"q": "Q1", "a": "A1", "prompt": "not this"}, {"q": "Q2", "a": "A2", "prompt": "nor this"}]
    src = make(tmp_path, kind, rows, prompt_field="q", answer_field="a")
    assert [(src.record(k).prompt, src.record(k).answer) for k in range(2)] == [("Q1", "A1"), ("Q2", "A2")]
    assert dict(src.record(0).metadata) == {"prompt": "not this"}


@pytest.mark.parametrize("kind", KINDS)
def test_system_prompt_field(tmp_path: Path, kind: str) -> None:
    rows = [{**r, "sys": s} for r, s in zip(ROWS, ["Be terse.", "Answer in French.", None], strict=True)]
    data: bytes | Rows = rows
    if kind == "csv":  # CSV has no null: a short row, whose missing cell reads as None, stands in for one
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(list(rows[0]))
        writer.writerows([list(r.values()) for r in rows[:2]] + [list(rows[2].values())[:-1]])
        data = out.getvalue().encode()
    src = make(tmp_path, kind, data, system_prompt_field="sys", system_prompt="Default.")
    assert [src.record(k).system_prompt for k in range(3)] == ["Be terse.", "Answer in French.", "Default."]
    assert "sys" not in src.record(0).metadata


def test_system_prompt_of_the_source(tmp_path: Path) -> None:
    src = make(tmp_path, "jsonl", ROWS, system_prompt="Be careful.")
    assert {src.record(k).system_prompt for k in range(3)} == {"Be careful."}


@pytest.mark.parametrize(
    ("answer", "text"),
    [(42, "42"), (2.5, "2.5"), (True, "true"), ([1, 2], "[1, 2]"), ({"b": 1, "a": [None]}, '{"b": 1, "a": [null]}')],
    ids=["int", "float", "bool", "list", "dict"],
)
def test_non_string_answers_are_json_encoded(tmp_path: Path, answer: Any, text: str) -> None:
    src = make(tmp_path, "jsonl", [{"prompt": "p", "answer": answer}])
    assert src.record(0).answer == text
    assert json.loads(src.record(0).answer or "") == answer


def test_non_string_answers_from_parquet(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "answer": 7, "sys": 3}, {"prompt": "q", "answer": -1, "sys": None}]
    src = make(tmp_path, "parquet", rows, system_prompt_field="sys")
    assert [src.record(k).answer for k in range(2)] == ["7", "-1"]
    assert [src.record(k).system_prompt for k in range(2)] == ["3", None]


def test_parquet_metadata_is_json_safe(tmp_path: Path) -> None:
    schema = pa.schema(
        [
            ("prompt", pa.string()),
            ("answer", pa.string()),
            ("day", pa.date32()),
            ("blob", pa.binary()),
            ("tags", pa.list_(pa.string())),
            ("score", pa.float64()),
            ("extra", pa.struct([("k", pa.int64())])),
        ]
    )
    row = {
        "prompt": "p",
        "answer": "a",
        "day": dt.date(2024, 1, 2),
        "blob": b"hi",
        "tags": ["x", "y"],
        "score": 0.5,
        "extra": {"k": 1},
    }
    metadata = make(tmp_path, "parquet", parquet_bytes([row], schema)).record(0).metadata
    assert dict(metadata) == {"day": "2024-01-02", "blob": "hi", "tags": ["x", "y"], "score": 0.5, "extra": {"k": 1}}
    json.dumps(dict(metadata))


def test_jsonl_keeps_metadata_types(tmp_path: Path) -> None:
    row = {"prompt": "p", "answer": "a", "n": 3, "f": 0.25, "ok": False, "none": None, "nested": {"x": [1]}}
    metadata = make(tmp_path, "jsonl", [row]).record(0).metadata
    assert dict(metadata) == {"n": 3, "f": 0.25, "ok": False, "none": None, "nested": {"x": [1]}}


def test_jsonl_skips_blank_lines_and_reads_crlf(tmp_path: Path) -> None:
    raw = b'\r\n{"prompt": "a", "answer": "1"}\r\n   \r\n{"prompt": "b", "answer": "2"}'  # no final newline
    src = make(tmp_path, "jsonl", raw)
    assert [(src.record(k).key, src.record(k).prompt) for k in range(src.size)] == [(0, "a"), (1, "b")]


def test_csv_with_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    raw = "\ufeffprompt,answer\r\nWhat is 1+1?,2\r\n".encode()
    src = make(tmp_path, "csv", raw)
    assert (src.size, src.record(0).prompt, src.record(0).answer) == (1, "What is 1+1?", "2")
    assert dict(src.record(0).metadata) == {}


def test_csv_row_missing_the_answer_cell(tmp_path: Path) -> None:
    err = data_error(tmp_path, "csv", b"prompt,answer\nq1,a1\nq2\n")
    assert err.field == "answer_field"
    assert str(err) == (
        "x.csv record 1 has no field 'answer'; set answer_field: null if this source has no reference answers"
    )


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"], ids=["LS", "PS", "NEL"])
def test_jsonl_text_with_unicode_line_separators(tmp_path: Path, char: str) -> None:
    rows = [{"prompt": f"line one{char}line two", "answer": "1"}, {"prompt": "next", "answer": "2"}]
    src = make(tmp_path, "jsonl", jsonl_bytes(rows))
    assert [src.record(k).prompt for k in range(src.size)] == [r["prompt"] for r in rows]


# --- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", [-1, 3, 1000], ids=str)
def test_out_of_range_key(tmp_path: Path, kind: str, key: int) -> None:
    src = make(tmp_path, kind, ROWS)
    with pytest.raises(KeyError):
        src.record(key)


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        ("jsonl", b""),
        ("jsonl", b"\n  \n\n"),
        ("csv", b""),
        ("csv", b"prompt,answer\n"),
        ("parquet", parquet_bytes([], pa.schema([("prompt", pa.string()), ("answer", pa.string())]))),
    ],
    ids=["jsonl-empty", "jsonl-blank-lines", "csv-empty", "csv-header-only", "parquet-no-rows"],
)
def test_empty_file(tmp_path: Path, kind: str, raw: bytes) -> None:
    err = data_error(tmp_path, kind, raw)
    assert (err.field, str(err)) == ("path", f"{(tmp_path / f'x.{kind}').resolve()} holds no records")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError) as exc:
        FileSource("x", spec("jsonl"), tmp_path)
    assert exc.value.field == "path"
    assert str(exc.value) == f"cannot read {(tmp_path / 'x.jsonl').resolve()}: No such file or directory"


def test_unreadable_parquet(tmp_path: Path) -> None:
    err = data_error(tmp_path, "parquet", b"this is not parquet")
    assert err.field == "path"
    assert str(err).startswith("not a readable Parquet file: ")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": \n', r"line 2 is not valid JSON: "),
        (b'{"prompt": "a", "answer": "1"}\n\n"just a string"\n', r"line 3 is a JSON str, not an object$"),
        (b"[1, 2]\n", r"line 1 is a JSON list, not an object$"),
    ],
    ids=["truncated", "string", "list"],
)
def test_bad_jsonl_line(tmp_path: Path, raw: bytes, message: str) -> None:
    err = data_error(tmp_path, "jsonl", raw)
    assert err.field == "path"
    assert re.match(message, str(err))


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_must_be_non_empty_text(tmp_path: Path, kind: str) -> None:
    err = data_error(tmp_path, kind, [ROWS[0], {**ROWS[1], "prompt": ""}])
    assert (err.field, str(err)) == ("prompt_field", f"x.{kind} record 1 has no non-empty text field 'prompt'")


# --- version ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_version_follows_the_bytes(tmp_path: Path, kind: str) -> None:
    v1 = make(tmp_path, kind, ROWS).version
    assert re.fullmatch(r"[0-9a-f]{10}", v1)
    assert make(tmp_path, kind, ROWS).version == v1
    assert make(tmp_path, kind, [*ROWS[:2], {**ROWS[2], "answer": "salut"}]).version != v1
    assert make(tmp_path, kind, ROWS).version == v1


def test_version_does_not_depend_on_the_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert make(tmp_path / "a", "jsonl", ROWS).version == make(tmp_path / "b", "jsonl", ROWS).version


@pytest.mark.parametrize(
    "change",
    [
        {"answer_field": "topic"},
        {"answer_field": None},
        {"metadata_fields": ["topic"]},
        {"system_prompt_field": "level"},
    ],
    ids=["answer_field", "no-answer", "metadata_fields", "system_prompt_field"],
)
def test_version_follows_the_field_mapping(tmp_path: Path, change: dict[str, Any]) -> None:
    assert make(tmp_path, "jsonl", ROWS, **change).version != make(tmp_path, "jsonl", ROWS).version


def test_sample_id(tmp_path: Path) -> None:
    src = make(tmp_path, "jsonl", ROWS)
    assert src.sample_id(2) == f"x:{src.version}:2"


def test_an_empty_answer_cell_is_a_missing_answer(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"x\.csv record 0 has no field 'answer'") as info:
        make(tmp_path, "csv", [{"prompt": "p", "answer": ""}])
    assert info.value.field == "answer_field"


# --- difficulty -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_record_difficulty_reads_the_difficulty_field(tmp_path: Path, kind: str) -> None:
    # CSV has text only, so "1" must read as 1.0 there as in the other kinds.
    src = make(tmp_path, kind, ROWS, difficulty_field="level")
    assert [src.record_difficulty(k) for k in range(src.size)] == [1.0, 2.0, 3.0]


def test_record_difficulty_takes_numbers_of_any_form(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "answer": "a", "d": d} for d in (0, 0.25, -2, "1e-3", " 0.5 ")]
    src = make(tmp_path, "jsonl", rows, difficulty_field="d")
    assert [src.record_difficulty(k) for k in range(src.size)] == [0.0, 0.25, -2.0, 0.001, 0.5]


def test_difficulty_is_kept_when_metadata_leaves_it_out(tmp_path: Path) -> None:
    src = make(tmp_path, "jsonl", ROWS, difficulty_field="level", metadata_fields=["topic"])
    assert src.record(2).metadata == {"topic": "fr\nnewline"}
    assert src.record_difficulty(2) == 3.0


def test_no_difficulty_field_means_no_record_difficulty(tmp_path: Path) -> None:
    src = make(tmp_path, "jsonl", ROWS)
    assert src.record_difficulty(0) is None
    assert src.source_difficulty() is None


@pytest.mark.parametrize("key", [-1, 3], ids=str)
def test_record_difficulty_of_a_missing_record(tmp_path: Path, key: int) -> None:
    src = make(tmp_path, "jsonl", ROWS, difficulty_field="level")
    with pytest.raises(KeyError):
        src.record_difficulty(key)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("hard", "'hard'"), (True, "True"), ("nan", "'nan'"), (float("inf"), "inf"), ([1], "[1]"), ({"x": 1}, "{'x': 1}")],
    ids=["word", "bool", "nan-text", "inf", "list", "object"],
)
def test_non_numeric_difficulty_is_refused_at_load(tmp_path: Path, value: Any, shown: str) -> None:
    rows = [{"prompt": "p", "answer": "a", "d": 1}, {"prompt": "q", "answer": "b", "d": value}]
    err = data_error(tmp_path, "jsonl", rows, difficulty_field="d")
    assert err.field == "difficulty_field"
    assert str(err) == (
        f"x.jsonl record 1: field 'd' is {shown}, not a finite number; every record needs a numeric difficulty"
    )


@pytest.mark.parametrize(
    "row", [{"prompt": "p", "answer": "a"}, {"prompt": "p", "answer": "a", "d": None}], ids=["absent", "null"]
)
def test_missing_difficulty_is_refused_at_load(tmp_path: Path, row: dict[str, Any]) -> None:
    err = data_error(tmp_path, "jsonl", [row], difficulty_field="d")
    assert (err.field, str(err)) == (
        "difficulty_field",
        "x.jsonl record 0 has no field 'd' to read its difficulty from",
    )


def test_empty_csv_difficulty_cell_is_missing(tmp_path: Path) -> None:
    err = data_error(tmp_path, "csv", [{"prompt": "p", "answer": "a", "d": ""}], difficulty_field="d")
    assert (err.field, str(err)) == ("difficulty_field", "x.csv record 0 has no field 'd' to read its difficulty from")


def test_difficulty_field_does_not_change_the_sample_ids(tmp_path: Path) -> None:
    # Which field holds the difficulty changes how records are chosen, not what sits behind a key.
    assert make(tmp_path, "jsonl", ROWS, difficulty_field="level").version == make(tmp_path, "jsonl", ROWS).version


def test_declared_source_difficulty(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_bytes(jsonl_bytes(ROWS))
    src = build_source("x", spec("jsonl", difficulty=0.7), base_dir=tmp_path, seed=0)
    assert src.source_difficulty() == 0.7
    assert src.record_difficulty(0) is None
