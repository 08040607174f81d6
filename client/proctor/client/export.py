"""``export_rollouts``: the experience store's kept steps as a file of rows, for analysis or rejection-sampling
SFT (``datasets.load_dataset("parquet", data_files=...)`` or ``"json"`` reads it).

One row per completion: ``table``, ``iteration``, ``slot``, ``index``, ``attempt``, ``latest``, then every
column written in its table (the prompt's columns, the completion, its reward and reward detail, and any a role
added). A cell not written is null. A step's loose completions (table ``-(iteration + 1)``: graded outside the
step's batch) have the step as ``iteration`` and the slot of its batch they answer, or null. A step generated
again (a run resumed from a checkpoint taken during its generation) holds several attempts at a row: each
distinct completion of a ``(slot, index)`` is an attempt, numbered in the order written, and ``latest`` marks
the one the resumed run went on with. Tables without a group size and
tables of loose completions give only the rows that hold a completion; a table opened with a group size gives
every row. Arrays (token ids, log-probs) become lists. In parquet, values that are JSON objects or mixed lists
(``reference``, ``reward_detail``) are JSON text, so that every table has one schema however its records'
fields vary; proctor's own columns are always there, with their types, in an export of no rows too (a file
with the schema and no row groups, which ``datasets`` loads as 0 rows with ``streaming=True``: without it,
``datasets`` refuses any empty split).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from proctor.client.experience import ExperienceClient
from proctor.experience import ExperienceStore, TableInfo
from proctor.experience import columns as col

__all__ = ["export_rollouts"]

_ROWS_PER_READ = 1024
_ATTEMPT, _LATEST = "attempt", "latest"


def export_rollouts(
    experience: ExperienceStore | ExperienceClient,
    out: str | Path,
    *,
    iterations: range | None = None,
    stages: Collection[str] | None = None,
    sources: Collection[str] | None = None,
    format: Literal["parquet", "jsonl"] | None = None,
) -> int:
    """Write the rows of the kept tables whose iteration is in ``iterations`` (all when None) to ``out``, as
    ``format`` (from the suffix when None: ``.parquet``, else JSON lines). Returns the rows written.

    ``stages`` and ``sources`` keep only the rows of those curriculum stages and sources (a row whose prompt's
    columns were never written has neither, and is left out by either filter)."""
    path = Path(out)
    fmt = format or ("parquet" if path.suffix == ".parquet" else "jsonl")
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {fmt!r}")
    steps: dict[int, list[TableInfo]] = {}
    for t in sorted(experience.tables(), key=lambda t: (_step(t.iteration), t.iteration < 0)):
        if iterations is None or _step(t.iteration) in iterations:
            steps.setdefault(_step(t.iteration), []).append(t)
    rows = (
        row
        for tables in steps.values()
        for row in _attempts([row for table in tables for row in _rows(experience, table)])
        if (stages is None or row.get(col.STAGE) in stages)
        and (sources is None or _source(row.get(col.SAMPLE_ID)) in sources)
    )
    if fmt == "jsonl":
        written = 0
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=_plain) + "\n")
                written += 1
        return written
    return _write_parquet(rows, path)


def _source(sample_id: object) -> str | None:
    """The source of a ``<source>:<version>:<record>`` sample id."""
    return sample_id.split(":", 1)[0] if isinstance(sample_id, str) else None


def _step(table: int) -> int:
    return table if table >= 0 else -table - 1


def _rows(experience: ExperienceStore | ExperienceClient, table: TableInfo) -> Iterator[dict[str, Any]]:
    loose = table.iteration < 0
    every = table.group_size is not None and not loose
    keys = [(s, k) for s in range(table.slots) for k in range(table.group_size or table.width)]
    names = sorted(table.written)
    for start in range(0, len(keys), _ROWS_PER_READ):
        part = keys[start : start + _ROWS_PER_READ]
        values = experience.read(table.iteration, part, names, missing="none") if names else {}
        for n, (slot, index) in enumerate(part):
            if not every and values.get(col.COMPLETION, [None] * len(part))[n] is None:
                continue  # a row that holds no completion: room for completions not written
            cells = {name: values[name][n] for name in names}
            step, step_slot = table.iteration, slot
            if loose:
                step, step_slot = cells.pop(col.STEP, step), cells.pop(col.STEP_SLOT, -1)
            row: dict[str, Any] = {
                "table": table.iteration,
                "iteration": step,
                "slot": None if step_slot is None or step_slot < 0 else step_slot,
                "index": index,
            }
            for name, v in cells.items():
                row[name] = v.tolist() if isinstance(v, np.ndarray) else v
            yield row


def _attempts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Number the attempts at each row of a step (its table's rows first, then its loose completions in the
    order written): each distinct completion of a ``(slot, index)`` is an attempt, and ``latest`` marks the
    last one. A completion posted again (a regrade) keeps its attempt's number; a row without a slot or a
    completion has neither."""
    seen: dict[tuple[int, int], list[Any]] = {}
    for row in rows:
        row[_ATTEMPT] = row[_LATEST] = None
        completion = row.get(col.COMPLETION)
        if row["slot"] is None or completion is None:
            continue
        attempts = seen.setdefault((row["slot"], row["index"]), [])
        if completion not in attempts:
            attempts.append(completion)
        row[_ATTEMPT] = attempts.index(completion)
    for row in rows:
        if row[_ATTEMPT] is not None:
            row[_LATEST] = row[_ATTEMPT] == len(seen[(row["slot"], row["index"])]) - 1
    return rows


def _write_parquet(rows: Iterable[dict[str, Any]], path: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("parquet needs pyarrow (pip install pyarrow), or export JSON lines") from None
    known = {
        "table": pa.int64(),
        "iteration": pa.int64(),
        "slot": pa.int64(),
        "index": pa.int64(),
        _ATTEMPT: pa.int64(),
        _LATEST: pa.bool_(),
        col.SAMPLE_ID: pa.string(),
        col.STAGE: pa.string(),
        col.PROMPT: pa.string(),
        col.REFERENCE: pa.string(),
        col.COMPLETION: pa.string(),
        col.COMPLETION_TOKENS: pa.int64(),
        col.COMPLETION_IDS: pa.list_(pa.int32()),
        col.REWARD: pa.float64(),
        col.REWARD_DETAIL: pa.string(),
    }
    flat = [_flat(row) for row in rows]
    names = list(dict.fromkeys([*known, *(name for row in flat for name in row)]))
    arrays = [pa.array([row.get(name) for row in flat], type=known.get(name)) for name in names]
    table = pa.Table.from_arrays(arrays, names=names)
    # No rows, no row group: a row group of 0 rows is one that readers (datasets among them) refuse.
    with pq.ParquetWriter(path, table.schema) as writer:
        if flat:
            writer.write_table(table)
    return len(flat)


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    return {k: json.dumps(v, ensure_ascii=False) if _nested(v) else v for k, v in row.items()}


def _nested(v: Any) -> bool:
    if isinstance(v, dict):
        return True
    if isinstance(v, list):
        return any(isinstance(x, dict | list | str) for x in v)
    return False


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON-able")
