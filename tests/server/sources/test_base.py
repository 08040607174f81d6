"""Tests for sample ids and content versions in :mod:`proctor.server.sources.base`."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.server.sources.base import Record, SampleId, Source, content_version
from proctor.server.spec import NAME_PATTERN

NAMES = st.from_regex(re.compile(NAME_PATTERN.removesuffix("$") + r"\Z"), fullmatch=True).filter(lambda s: len(s) < 40)
VERSIONS = st.text("0123456789abcdef", min_size=10, max_size=10)
KEYS = st.integers(min_value=0, max_value=2**80)


@settings(max_examples=150, deadline=None)
@given(source=NAMES, version=VERSIONS, key=KEYS)
def test_parse_round_trips(source: str, version: str, key: int) -> None:
    sid = SampleId(source, version, key)
    text = str(sid)
    assert text == f"{source}:{version}:{key}"
    assert SampleId.parse(text) == sid


@pytest.mark.parametrize(
    "text",
    [
        "",
        "add",
        "add:7",
        "add:0123456789",
        "add:0123456789:",
        "add::7",
        ":0123456789:7",
        "add:012345678:7",
        "add:0123456789a:7",
        "add:ABCDEF0123:7",
        "add:012345678g:7",
        "add:0123456789:-1",
        "add:0123456789:+1",
        "add:0123456789:07",
        "add:0123456789:00",
        "add:0123456789:1.0",
        "add:0123456789:1e3",
        "add:0123456789:x",
        " add:0123456789:7",
        "add :0123456789:7",
        "add: 0123456789:7",
        "add:0123456789: 7",
        "add:0123456789:7 ",
        "add:0123456789:7\t",
        "a dd:0123456789:7",
        "add:0123456789:7:8",
        "x:add:0123456789:7",
        "add:0123456789::7",
        "_add:0123456789:7",
        "-add:0123456789:7",
        "ad/d:0123456789:7",
        "add:0123456789:٣",
    ],
    ids=lambda t: repr(t),
)
def test_malformed_ids_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected '<source>:<10 hex version>:<record>'"):
        SampleId.parse(text)


def test_trailing_newline_is_refused() -> None:
    with pytest.raises(ValueError, match="expected"):
        SampleId.parse("add:0123456789:7\n")


def test_error_message_quotes_at_most_80_characters() -> None:
    text = "x" * 500
    with pytest.raises(ValueError) as exc:
        SampleId.parse(text)
    message = str(exc.value)
    assert repr("x" * 80) in message
    assert "x" * 81 not in message
    assert "exactly as /sample returned it" in message


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("add:0123456789:0", SampleId("add", "0123456789", 0)),
        (
            "a.b-c_d:ffffffffff:123456789012345678901234567890",
            SampleId("a.b-c_d", "ffffffffff", 123456789012345678901234567890),
        ),
        ("9:abcdef0123:10", SampleId("9", "abcdef0123", 10)),
    ],
    ids=["zero", "long", "digit-name"],
)
def test_parse_examples(text: str, parsed: SampleId) -> None:
    assert SampleId.parse(text) == parsed


class _Tiny(Source):
    kind = "tiny"

    @property
    def size(self) -> int:
        return 1

    def record(self, key: int) -> Record:
        if key != 0:
            raise KeyError(key)
        return Record(key=0, prompt="p")


def test_source_sample_id_is_what_parse_reads() -> None:
    src = _Tiny("tiny", content_version("v"))
    assert SampleId.parse(src.sample_id(0)) == SampleId("tiny", src.version, 0)


def test_record_defaults() -> None:
    record = Record(key=1, prompt="p")
    assert (record.answer, record.system_prompt, dict(record.metadata)) == (None, None, {})


# --- content_version --------------------------------------------------------------------------------------


def test_content_version_is_a_stable_short_hex_digest() -> None:
    v = content_version("gen/1", 17, "add", {"ops": ["+"], "digits": [1, 2]})
    assert re.fullmatch(r"[0-9a-f]{10}", v)
    assert v == content_version("gen/1", 17, "add", {"digits": [1, 2], "ops": ["+"]})  # key order is irrelevant


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((b"ab", b"c"), (b"a", b"bc")),
        (("ab", "c"), ("a", "bc")),
        ((b"x",), ("x",)),
        ((1,), ("1",)),
        ((1,), (1.0,)),
        ((None,), ()),
        (({"a": 1},), ({"a": 2},)),
        ((b"data", {"prompt_field": "q"}), (b"data", {"prompt_field": "p"})),
    ],
    ids=[
        "bytes-split",
        "str-split",
        "bytes-vs-str",
        "int-vs-str",
        "int-vs-float",
        "none-vs-nothing",
        "dict",
        "mapping",
    ],
)
def test_content_version_tells_parts_apart(a: tuple[object, ...], b: tuple[object, ...]) -> None:
    assert content_version(*a) != content_version(*b)
