"""Column values and their encodings.

A cell holds a JSON-able value (a reward, a text, a dict of components) or a numpy array (token ids,
log-probs). Arrays are never JSON lists of numbers: in SQLite they are their raw little-endian bytes behind a
short header, and on the wire base64 of those bytes with the dtype and shape beside them, so a 512-token
``float32`` column is 2 KiB of bytes, parsed by ``numpy.frombuffer`` rather than by a JSON number parser.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from proctor.experience.errors import ExperienceInputError

__all__ = [
    "DTYPES",
    "MAX_NDIM",
    "Value",
    "as_stored",
    "cell_json",
    "cell_wire_array",
    "decode_cell",
    "decode_cells",
    "decode_columns",
    "encode_cell",
    "from_wire_array",
    "to_wire_array",
]

Value: TypeAlias = Any  # a JSON-able value, or a numpy array of one of DTYPES
"""What a cell holds."""

# The dtypes a cell may hold, by their wire names; each has one code in the stored header.
DTYPES: tuple[str, ...] = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
)
MAX_NDIM = 4
_CODE = {name: n for n, name in enumerate(DTYPES)}
_JSON, _ARRAY = 0, 1  # the first byte of a stored cell
_JSON_PREFIX = bytes([_JSON])
_JSON_NULL = _JSON_PREFIX + b"null"
# One encoder for every cell: json.dumps with options builds a new one per call, most of a short cell's cost.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _check_array(field: str, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    name = array.dtype.name
    if name not in _CODE:
        raise ExperienceInputError(field, f"arrays of dtype {name} are not stored; use one of {', '.join(DTYPES)}")
    if array.ndim > MAX_NDIM:
        raise ExperienceInputError(field, f"an array of {array.ndim} dimensions; at most {MAX_NDIM} are stored")
    return array


def encode_cell(field: str, value: Value) -> bytes:
    """The stored bytes of one cell: a kind byte, then JSON text or an array header and its raw bytes."""
    if isinstance(value, np.generic):  # a numpy scalar (a float32 reward, say) is stored as its Python value
        value = value.item()
    if isinstance(value, np.ndarray):
        array = _check_array(field, value)
        header = struct.pack(f"<BBB{array.ndim}I", _ARRAY, _CODE[array.dtype.name], array.ndim, *array.shape)
        return header + np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    # The JSON text of the scalars most cells hold (rewards, token counts, a missing value), as the encoder
    # writes it, without its general path: most of a short cell's cost.
    kind = type(value)
    if value is None:
        return _JSON_NULL
    if kind is int:
        return _JSON_PREFIX + int.__repr__(value).encode()
    if kind is float and math.isfinite(value):
        return _JSON_PREFIX + float.__repr__(value).encode()
    try:
        return _JSON_PREFIX + _ENCODER.encode(value).encode()
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        raise ExperienceInputError(field, f"not JSON-able and not a numpy array ({exc})") from None


def decode_cell(data: bytes) -> Value:
    """The value of stored cell bytes (see :func:`encode_cell`)."""
    if data[0] == _JSON:
        return json.loads(data[1:])
    code, ndim = data[1], data[2]
    shape = struct.unpack_from(f"<{ndim}I", data, 3)
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    return np.frombuffer(data, dtype=dtype, offset=3 + 4 * ndim).reshape(shape).astype(dtype.newbyteorder("="))


def decode_cells(cells: Sequence[bytes | None]) -> list[Value]:
    """The values of stored cells, ``None`` where a cell is ``None``: :func:`decode_cell` of each. A column of JSON
    cells is parsed as one JSON array, a fifth of the time of a parse per cell for short ones (rewards, texts)."""
    if any(cell is not None and cell[0] != _JSON for cell in cells):
        return [None if cell is None else decode_cell(cell) for cell in cells]
    values: list[Value] = json.loads(b"[" + b",".join(b"null" if c is None else c[1:] for c in cells) + b"]")
    return values


def cell_json(data: bytes) -> bytes | None:
    """The JSON text of a JSON cell's value, as stored (nothing decoded); None for an array cell."""
    return data[1:] if data[0] == _JSON else None


def cell_wire_array(data: bytes) -> dict[str, Any]:
    """An array cell as :func:`to_wire_array` gives its array, from its stored bytes (nothing decoded): they
    are the array's little-endian bytes already."""
    ndim = data[2]
    shape = list(struct.unpack_from(f"<{ndim}I", data, 3))
    return {"dtype": DTYPES[data[1]], "shape": shape, "data": base64.b64encode(data[3 + 4 * ndim :]).decode()}


def as_stored(columns: Mapping[str, Sequence[Value]]) -> dict[str, list[Value]]:
    """The values as the store would read them back, or the :class:`ExperienceInputError` it would raise.

    A client sends this rather than what it was given: a JSON encoder would quietly turn a set into a list
    and NaN into null, and the server would store what the caller never wrote.
    """
    return {
        name: [
            v if isinstance(v, np.ndarray) else decode_cell(encode_cell(f"columns.{name}[{n}]", v))
            for n, v in enumerate(values)
        ]
        for name, values in columns.items()
    }


def to_wire_array(array: npt.NDArray[Any]) -> dict[str, Any]:
    """An array as the wire carries it: ``{"dtype", "shape", "data"}``, data the base64 of its bytes."""
    array = _check_array("array", array)
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": base64.b64encode(raw).decode()}


def from_wire_array(field: str, dtype: str, shape: Sequence[int], data: str) -> npt.NDArray[Any]:
    """The array a wire array stands for, checked: a known dtype, and as many bytes as its shape needs."""
    if dtype not in _CODE:
        raise ExperienceInputError(f"{field}.dtype", f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if len(shape) > MAX_NDIM or any(n < 0 for n in shape):
        raise ExperienceInputError(f"{field}.shape", f"{list(shape)} is not a shape of at most {MAX_NDIM} sizes ≥ 0")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ExperienceInputError(
            f"{field}.data", "not base64 (the array's little-endian bytes, base64-encoded)"
        ) from None
    dt = np.dtype(dtype).newbyteorder("<")
    need = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    if len(raw) != need:
        raise ExperienceInputError(
            f"{field}.data", f"{len(raw)} bytes, but shape {list(shape)} of {dtype} needs {need}; send the raw array"
        )
    return np.frombuffer(raw, dtype=dt).reshape(tuple(shape)).astype(dt.newbyteorder("="))


def decode_columns(cells: Mapping[str, list[bytes | None]]) -> dict[str, list[Value]]:
    """Each column's stored cells decoded (:func:`decode_cells`)."""
    return {name: decode_cells(column) for name, column in cells.items()}
