"""Cell encodings: JSON values and numpy arrays round-trip through the stored form and the wire form, arrays are
stored as raw bytes, and what cannot be stored is refused with the field named."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from proctor.experience import Dispatch, ExperienceInputError
from proctor.experience.values import (
    DTYPES,
    MAX_NDIM,
    decode_cell,
    decode_cells,
    encode_cell,
    from_wire_array,
    to_wire_array,
)
from proctor.wire import experience as dw

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@st.composite
def stored_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    """An array of a stored dtype, in either byte order, up to 3 small dimensions (0-d and empty included)."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    if dtype.itemsize > 1:
        dtype = dtype.newbyteorder(draw(st.sampled_from("<>")))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    return draw(hnp.arrays(dtype, shape))


def assert_same_array(got: Any, expected: np.ndarray[Any, Any]) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype.name == expected.dtype.name
    assert got.dtype.isnative
    assert got.shape == expected.shape
    # Bytes, not values: NaN payloads and -0.0 must come back as they went in.
    native = expected.astype(expected.dtype.newbyteorder("="))
    assert got.tobytes() == native.tobytes()


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_json_values_round_trip(value: Any) -> None:
    stored = encode_cell("x", value)
    decoded = decode_cell(stored)
    assert decoded == value
    assert json.dumps(decoded) == json.dumps(value)
    assert encode_cell("x", decoded) == stored


@settings(max_examples=300, deadline=None)
@given(
    json_values | st.integers(min_value=-(2**80), max_value=2**80) | st.floats(allow_nan=False, allow_infinity=False)
)
def test_a_json_cell_is_stored_as_its_json_text(value: Any) -> None:
    # The stored bytes are compared to tell a retried write from a conflicting one: a value must be stored as
    # the same bytes by every version, whatever path its encoding takes.
    assert encode_cell("x", value) == b"\x00" + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_float_json_cannot_hold_is_refused(value: float) -> None:
    with pytest.raises(ExperienceInputError, match=r"^x: not JSON-able"):
        encode_cell("x", value)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.none() | json_values.map(lambda v: encode_cell("x", v)) | stored_arrays().map(lambda a: encode_cell("x", a)),
        max_size=8,
    )
)
def test_a_column_decodes_as_each_of_its_cells_does(cells: list[bytes | None]) -> None:
    # A column of JSON cells is parsed as one JSON array: each value must be what its own parse gives.
    decoded = decode_cells(cells)
    assert len(decoded) == len(cells)
    for got, cell in zip(decoded, cells, strict=True):
        if cell is None:
            assert got is None
        elif cell[0] == 0:
            expected = decode_cell(cell)
            assert got == expected
            assert json.dumps(got) == json.dumps(expected)
        else:
            assert_same_array(got, decode_cell(cell))


@settings(max_examples=200, deadline=None)
@given(stored_arrays())
def test_arrays_round_trip_through_the_stored_form(array: np.ndarray[Any, Any]) -> None:
    assert_same_array(decode_cell(encode_cell("x", array)), array)


@settings(max_examples=200, deadline=None)
@given(stored_arrays())
def test_arrays_round_trip_through_the_wire_form(array: np.ndarray[Any, Any]) -> None:
    wire = to_wire_array(array)
    assert set(wire) == {"dtype", "shape", "data"}
    assert wire["dtype"] == array.dtype.name
    assert wire["shape"] == list(array.shape)
    json.dumps(wire)
    assert_same_array(from_wire_array("x", wire["dtype"], wire["shape"], wire["data"]), array)


def wire_columns(body: bytes, model: type[dw.ReadBody] | type[dw.DispatchBody]) -> dict[str, list[Any]]:
    """The columns a client reads back from a read's or a dispatch's JSON."""
    return dw.columns_from_wire(model.model_validate_json(body).columns)


# A column as a read finds it: a value per row, or None where a row's cell is not written.
json_columns = st.lists(st.one_of(st.just(None), json_values.map(lambda v: ("value", v))), max_size=6)
array_columns = st.lists(st.one_of(st.just(None), stored_arrays().map(lambda a: ("value", a))), max_size=6)


def cells_of(column: list[Any]) -> list[bytes | None]:
    return [None if cell is None else encode_cell("x", cell[1]) for cell in column]


@settings(max_examples=200, deadline=None)
@given(json_columns, array_columns)
def test_stored_cells_go_on_the_wire_as_their_values_would(texts: list[Any], arrays: list[Any]) -> None:
    cells = {"text": cells_of(texts), "ids": cells_of(arrays)}
    for got in (
        wire_columns(dw.read_json(cells), dw.ReadBody),
        wire_columns(dw.dispatch_json(Dispatch("c", 0, "l", 1.0, (), cells, ())), dw.DispatchBody),
    ):
        assert json.dumps(got["text"]) == json.dumps([None if c is None else c[1] for c in texts])
        assert len(got["ids"]) == len(arrays)
        for value, cell in zip(got["ids"], arrays, strict=True):
            if cell is None:
                assert value is None
            else:
                assert_same_array(value, cell[1])


def test_a_column_of_arrays_and_other_values_is_refused_naming_it() -> None:
    cells = {"mixed": [encode_cell("x", np.zeros(2, np.int32)), encode_cell("x", 3)]}
    with pytest.raises(ExperienceInputError, match=r"columns\.mixed: mixes numpy arrays and other values"):
        dw.read_json(cells)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],
        np.arange(24, dtype=np.float64).reshape(4, 6).T,
        np.arange(10, dtype=np.int16)[::-3],
    ],
    ids=["strided", "transposed", "reversed"],
)
def test_arrays_that_are_not_contiguous_round_trip(array: np.ndarray[Any, Any]) -> None:
    assert not array.flags.c_contiguous
    assert_same_array(decode_cell(encode_cell("x", array)), array)
    wire = to_wire_array(array)
    assert_same_array(from_wire_array("x", wire["dtype"], wire["shape"], wire["data"]), array)


def test_an_array_is_stored_as_its_raw_bytes() -> None:
    assert len(encode_cell("x", np.zeros(512, np.float32))) < 2_100
    assert len(encode_cell("x", np.zeros((8, 64), np.int64))) < 8 * 64 * 8 + 100
    wire = to_wire_array(np.zeros(512, np.float32))
    assert len(wire["data"]) == 4 * -(-512 * 4 // 3)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1, 2}, "y: not JSON-able and not a numpy array"),
        (float("nan"), "y: not JSON-able"),
        (float("inf"), "y: not JSON-able"),
        ([1, {"a": float("-inf")}], "y: not JSON-able"),
        (object(), "y: not JSON-able"),
        (b"raw", "y: not JSON-able"),
        (np.array([1 + 2j]), "y: arrays of dtype complex128 are not stored"),
        (np.array([1, 2], dtype=np.uint32), "y: arrays of dtype uint32 are not stored"),
        (np.array(["ab"]), "y: arrays of dtype str64 are not stored"),
        (np.array([{}, 1], dtype=object), "y: arrays of dtype object are not stored"),
        (np.zeros((1,) * (MAX_NDIM + 1), np.float32), f"y: an array of {MAX_NDIM + 1} dimensions; at most {MAX_NDIM}"),
    ],
    ids=[
        "set",
        "nan",
        "inf",
        "nested-inf",
        "object",
        "bytes",
        "complex",
        "uint32",
        "str-array",
        "object-array",
        "ndim",
    ],
)
def test_a_value_that_cannot_be_stored_is_refused_naming_the_field(value: Any, message: str) -> None:
    with pytest.raises(ExperienceInputError, match="^" + re.escape(message)) as caught:
        encode_cell("y", value)
    assert caught.value.field == "y"


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array([1 + 2j]), "array: arrays of dtype complex128 are not stored"),
        (np.array([None], dtype=object), "array: arrays of dtype object are not stored"),
        (np.zeros((1,) * (MAX_NDIM + 1), np.int8), f"array: an array of {MAX_NDIM + 1} dimensions"),
    ],
    ids=["complex", "object", "ndim"],
)
def test_an_array_that_cannot_go_on_the_wire_is_refused(array: np.ndarray[Any, Any], message: str) -> None:
    with pytest.raises(ExperienceInputError, match="^" + re.escape(message)):
        to_wire_array(array)


@pytest.mark.parametrize(
    ("dtype", "shape", "data", "field", "message"),
    [
        ("complex64", [1], "AAAAAAAAAAA=", "x.dtype", "unknown dtype 'complex64'"),
        ("object", [1], "", "x.dtype", "unknown dtype 'object'"),
        ("int32", [2], "AAAA", "x.data", "3 bytes, but shape [2] of int32 needs 8"),
        ("float32", [2, 2], "AAAAAAAAAAA=", "x.data", "8 bytes, but shape [2, 2] of float32 needs 16"),
        ("int8", [], "", "x.data", "0 bytes, but shape [] of int8 needs 1"),
        ("int32", [1], "!!not base64!!", "x.data", "not base64"),
        ("int32", [1], "AAAAAA", "x.data", "not base64"),
        ("int8", [1] * (MAX_NDIM + 1), "AA==", "x.shape", f"is not a shape of at most {MAX_NDIM} sizes"),
        ("int8", [2, -1], "", "x.shape", "[2, -1] is not a shape"),
    ],
    ids=["complex64", "object", "short", "short-2d", "scalar-empty", "not-base64", "bad-padding", "ndim", "negative"],
)
def test_a_bad_wire_array_is_refused_naming_the_field(
    dtype: str, shape: list[int], data: str, field: str, message: str
) -> None:
    with pytest.raises(ExperienceInputError, match="^" + re.escape(f"{field}: ") + ".*" + re.escape(message)) as caught:
        from_wire_array("x", dtype, shape, data)
    assert caught.value.field == field


def test_a_string_with_a_lone_surrogate_is_stored_or_refused_as_an_input_error() -> None:
    value = "half a pair: \ud800"
    try:
        stored = encode_cell("y", value)
    except ExperienceInputError as exc:
        assert exc.field == "y"
        return
    assert decode_cell(stored) == value
