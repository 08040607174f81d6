"""Records from local JSONL, Parquet and CSV files, loaded into memory at start-up.

The version is a digest of the file's bytes and the field mapping: editing the file or the mapping gives
new sample ids, and ids handed out before the edit are refused at grading time instead of being matched
against whatever row now sits at their index.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from proctor.server.exceptions import ProctorError
from proctor.server.sources.base import Record, Source, content_version
from proctor.server.spec import FileSourceSpec

__all__ = ["FileSource", "SourceDataError"]


class SourceDataError(ProctorError, ValueError):
    """A data file that cannot be used; ``field`` is the spec field to point the author at."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class FileSource(Source):
    def __init__(self, name: str, spec: FileSourceSpec, base_dir: Path) -> None:
        path = (base_dir / spec.path).resolve()
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SourceDataError("path", f"cannot read {path}: {exc.strerror or exc}") from None
        mapping = spec.model_dump(
            include={"kind", "prompt_field", "answer_field", "system_prompt_field", "metadata_fields"}
        )
        super().__init__(name, content_version(raw, mapping))
        self.kind = spec.kind
        self.path = path
        self.spec = spec
        self._records: list[Record] = []
        # Kept apart from the records: metadata_fields may well leave the difficulty field out of them.
        difficulties: list[float] | None = None if spec.difficulty_field is None else []
        for i, row in enumerate(_read_rows(spec.kind, raw)):
            self._records.append(self._to_record(i, row))
            if difficulties is not None:
                difficulties.append(self._difficulty(i, row))
        if not self._records:
            raise SourceDataError("path", f"{path} holds no records")
        self._difficulties = None if difficulties is None else np.array(difficulties, dtype=np.float64)

    @property
    def size(self) -> int:
        return len(self._records)

    def record(self, key: int) -> Record:
        if not 0 <= key < len(self._records):
            raise KeyError(key)
        return self._records[key]

    def record_difficulties(self) -> npt.NDArray[np.float64] | None:
        """Each record's ``difficulty_field`` as a number; ``None`` when the spec names no such field."""
        return self._difficulties

    def _difficulty(self, index: int, row: dict[str, Any]) -> float:
        field = self.spec.difficulty_field
        assert field is not None
        where = f"{self.path.name} record {index}"
        value = row.get(field)
        if value is None or value == "":
            raise SourceDataError("difficulty_field", f"{where} has no field {field!r} to read its difficulty from")
        # CSV hands every value over as text, so a numeric string counts as a number; a bool does not.
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not math.isfinite(number):
            raise SourceDataError(
                "difficulty_field",
                f"{where}: field {field!r} is {value!r}, not a finite number; every record needs a numeric difficulty",
            )
        return number

    def _to_record(self, index: int, row: dict[str, Any]) -> Record:
        spec = self.spec
        where = f"{self.path.name} record {index}"
        prompt = row.get(spec.prompt_field)
        if not isinstance(prompt, str) or not prompt:
            raise SourceDataError("prompt_field", f"{where} has no non-empty text field {spec.prompt_field!r}")
        answer = None
        if spec.answer_field is not None:
            if row.get(spec.answer_field) in (None, ""):
                raise SourceDataError(
                    "answer_field",
                    f"{where} has no field {spec.answer_field!r}; "
                    "set answer_field: null if this source has no reference answers",
                )
            answer = _as_text(row[spec.answer_field])
        system_prompt = spec.system_prompt
        if spec.system_prompt_field is not None and row.get(spec.system_prompt_field) not in (None, ""):
            system_prompt = _as_text(row[spec.system_prompt_field])
        used = {spec.prompt_field, spec.answer_field, spec.system_prompt_field}
        fields = spec.metadata_fields if spec.metadata_fields is not None else [k for k in row if k not in used]
        missing = [f for f in fields if f not in row]
        if missing:
            raise SourceDataError("metadata_fields", f"{where} has no field(s) {', '.join(map(repr, missing))}")
        metadata = {f: _json_safe(row[f]) for f in fields}
        return Record(key=index, prompt=prompt, answer=answer, system_prompt=system_prompt, metadata=metadata)


def _read_rows(kind: str, raw: bytes) -> Iterator[dict[str, Any]]:
    if kind == "jsonl":
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and friends, which splitlines() breaks at.
        for lineno, line in enumerate(raw.decode("utf-8-sig").split("\n"), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceDataError("path", f"line {lineno} is not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise SourceDataError("path", f"line {lineno} is a JSON {type(row).__name__}, not an object")
            yield row
    elif kind == "csv":
        yield from csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
    elif kind == "parquet":
        import pyarrow.parquet as pq  # only parquet curricula pay for the import

        try:
            table = pq.read_table(io.BytesIO(raw))
        except Exception as exc:  # pyarrow raises a zoo of types for a bad file
            raise SourceDataError("path", f"not a readable Parquet file: {exc}") from None
        yield from table.to_pylist()
    else:  # pragma: no cover - the spec's Literal rules this out
        raise SourceDataError("kind", f"unsupported kind {kind!r}")


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(_json_safe(value))


def _json_safe(value: Any) -> Any:
    """Parquet hands back dates, decimals and bytes; the wire wants JSON."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
