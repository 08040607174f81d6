"""``TransferDock``'s behaviour through its public methods: tables, consumers, write-once cells, reads by index,
dispatch (readiness, leases, groups, data-parallel parts, token balance), collect, lease expiry and renewal,
consumption, ``consume``, and the errors of bad inputs.

Only public methods of the store and ``proctor.dock.consume`` are used, so the same tests can run against the
HTTP client. Leases expire on the real clock: a short lease, then a sleep past it.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from proctor.batching.vocabulary import derive_batch_plan
from proctor.dock import (
    CellConflictError,
    CellsMissingError,
    Collected,
    Consumer,
    Consumption,
    Dispatch,
    DockInputError,
    LeaseError,
    RowKey,
    ShapeConflictError,
    TransferDock,
    UnknownConsumerError,
    UnknownIterationError,
    Value,
    consume,
)
from proctor.dock.columns import GRADER

SHORT_LEASE_S = 0.3
PAST_SHORT_LEASE_S = 0.45


def all_rows(slots: int, group_size: int) -> list[RowKey]:
    return [(s, k) for s in range(slots) for k in range(group_size)]


def registered(dock: TransferDock) -> list[Consumer]:
    """The consumers a test registered: the dataserver registers its own grader role as it starts."""
    return [c for c in dock.consumers() if c != GRADER]


def covered_once(parts: Sequence[Sequence[int]], n: int) -> bool:
    flat = [p for part in parts for p in part]
    return sorted(flat) == list(range(n))


def ready_table(dock: TransferDock, slots: int = 4, group_size: int = 2, iteration: int = 0) -> list[RowKey]:
    """A table whose ``prompt`` column is written in every row, and a consumer ``scorer`` that needs it."""
    rows = all_rows(slots, group_size)
    dock.open(iteration, slots=slots, group_size=group_size)
    dock.register("scorer", needs=["prompt"], produces=["score"])
    dock.put(iteration, rows, {"prompt": [f"p{s}.{k}" for s, k in rows]})
    return rows


def counts(dock: TransferDock, consumer: str, iteration: int) -> tuple[int, int, int, int]:
    c = dock.consumption(consumer, iteration)
    return (c.rows, c.consumed, c.held, c.ready)


# --- tables ---------------------------------------------------------------------------------------------------


def test_open_returns_the_shape_and_is_idempotent(dock: TransferDock) -> None:
    info = dock.open(3, slots=4, group_size=2)
    assert (info.iteration, info.slots, info.group_size, info.rows) == (3, 4, 2, 8)
    assert dict(info.written) == {}
    again = dock.open(3, slots=4, group_size=2)
    assert (again.iteration, again.slots, again.group_size, dict(again.written)) == (3, 4, 2, {})
    assert [t.iteration for t in dock.tables()] == [3]
    assert dock.table(3).rows == 8


def test_open_again_keeps_what_was_written(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=2)
    dock.put(0, [(0, 0), (1, 1)], {"prompt": ["a", "b"]})
    assert dict(dock.open(0, slots=2, group_size=2).written) == {"prompt": 2}


def test_open_with_another_shape_is_a_shape_conflict_naming_both(dock: TransferDock) -> None:
    dock.open(1, slots=4, group_size=2)
    with pytest.raises(ShapeConflictError) as caught:
        dock.open(1, slots=5, group_size=3)
    message = str(caught.value)
    assert "4 slots × group_size 2" in message
    assert "5 × 3" in message
    assert dock.table(1).slots == 4


def test_tables_are_listed_oldest_first_with_written_counts(dock: TransferDock) -> None:
    for iteration in (5, 2, 7):
        dock.open(iteration, slots=2, group_size=3)
    dock.put(5, [(0, 0), (0, 1), (1, 2)], {"prompt": ["a", "b", "c"]})
    dock.put(5, [(1, 0)], {"reward": [1.0]})
    assert [t.iteration for t in dock.tables()] == [2, 5, 7]
    assert dict(dock.table(5).written) == {"prompt": 3, "reward": 1}
    assert dict(dock.table(2).written) == {}


def test_unknown_iteration_is_refused_by_every_call_that_names_one(dock: TransferDock) -> None:
    with pytest.raises(UnknownIterationError, match="iteration 9 has no table"):
        dock.table(9)
    dock.open(0, slots=1, group_size=1)
    dock.register("scorer", needs=["prompt"])
    calls: list[Callable[[], object]] = [
        lambda: dock.table(9),
        lambda: dock.put(9, [(0, 0)], {"prompt": ["a"]}),
        lambda: dock.read(9, [(0, 0)], ["prompt"]),
        lambda: dock.dispatch("scorer", 1, iteration=9),
        lambda: dock.consumption("scorer", 9),
        lambda: dock.all_consumed("scorer", 9),
    ]
    for call in calls:
        with pytest.raises(UnknownIterationError, match=r"iteration 9 has no table \(kept: 0\.\.0\)"):
            call()


# --- consumers ------------------------------------------------------------------------------------------------


def test_register_returns_the_consumer_and_is_idempotent(dock: TransferDock) -> None:
    first = dock.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4)
    assert first == Consumer("reward", ("prompt", "response"), ("score",), 4)
    assert dock.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4) == first
    dock.register("actor", needs=["prompt"])
    assert [c.name for c in registered(dock)] == ["actor", "reward"]
    assert registered(dock)[0] == Consumer("actor", ("prompt",), (), None)


@pytest.mark.parametrize(
    "changed",
    [
        {"needs": ["prompt"], "produces": ["score"], "dispatch_size": 4},
        {"needs": ["prompt", "response"], "produces": ["score", "extra"], "dispatch_size": 4},
        {"needs": ["prompt", "response"], "produces": ["score"], "dispatch_size": 8},
        {"needs": ["prompt", "response"], "produces": ["score"]},
    ],
    ids=["needs", "produces", "dispatch_size", "no-dispatch_size"],
)
def test_register_with_other_columns_is_a_shape_conflict(dock: TransferDock, changed: dict[str, Any]) -> None:
    dock.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4)
    with pytest.raises(
        ShapeConflictError, match=re.escape("consumer 'reward' is registered as needs=['prompt', 'response']")
    ):
        dock.register("reward", **changed)
    assert registered(dock) == [Consumer("reward", ("prompt", "response"), ("score",), 4)]


def test_unknown_consumer_is_refused(dock: TransferDock) -> None:
    dock.open(0, slots=1, group_size=1)
    calls: list[Callable[[], object]] = [
        lambda: dock.dispatch("nobody", 1),
        lambda: dock.consumption("nobody", 0),
        lambda: dock.all_consumed("nobody", 0),
    ]
    for call in calls:
        with pytest.raises(UnknownConsumerError, match="consumer 'nobody' is not registered"):
            call()


# --- put and read ---------------------------------------------------------------------------------------------

JSON_VALUES: list[Value] = [
    0.5,
    -3,
    2**60,
    'a text ✓ with "quotes" and \n newlines',
    None,
    True,
    [],
    {"components": {"format": 1.0, "answer": [0, 1, None]}, "note": ""},
]


def test_put_and_read_round_trip_json_values(dock: TransferDock) -> None:
    dock.open(0, slots=len(JSON_VALUES), group_size=1)
    rows = all_rows(len(JSON_VALUES), 1)
    dock.put(0, rows, {"value": JSON_VALUES})
    assert dock.read(0, rows, ["value"]) == {"value": JSON_VALUES}
    assert dock.read(0, rows[::-1], ["value"]) == {"value": JSON_VALUES[::-1]}


ARRAYS: list[np.ndarray[Any, Any]] = [
    np.array([3, 1, 4, 1, 5], dtype=np.int32),
    np.array([-(2**40), 0, 2**40], dtype=np.int64),
    np.array([0, 255, 7], dtype=np.uint8),
    np.array([-128, 127], dtype=np.int8),
    np.array([True, False, True], dtype=np.bool_),
    np.array([0.5, -1.25, 65504.0], dtype=np.float16),
    np.linspace(-1, 1, 7, dtype=np.float32),
    np.array([np.pi, -np.e, 1e300], dtype=np.float64),
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.zeros((2, 0, 3), dtype=np.int16),
    np.array(7, dtype=np.int64),
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype.name}{list(a.shape)}")
def test_put_and_read_round_trip_arrays(dock: TransferDock, array: np.ndarray[Any, Any]) -> None:
    dock.open(0, slots=2, group_size=1)
    other = np.ones(3, dtype=array.dtype)
    dock.put(0, [(0, 0), (1, 0)], {"tokens": [array, other]})
    got = dock.read(0, [(1, 0), (0, 0)], ["tokens"])["tokens"]
    for value, expected in zip(got, [other, array], strict=True):
        assert isinstance(value, np.ndarray)
        assert value.dtype == expected.dtype
        assert value.shape == expected.shape
        assert np.array_equal(value, expected)


def test_read_several_columns_in_the_order_of_the_rows_asked(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=2)
    rows = all_rows(2, 2)
    dock.put(0, rows, {"text": ["a", "b", "c", "d"], "ids": [np.arange(n, dtype=np.int32) for n in range(1, 5)]})
    got = dock.read(0, [(1, 1), (0, 0)], ["text", "ids"])
    assert got["text"] == ["d", "a"]
    assert [len(v) for v in got["ids"]] == [4, 1]


def test_a_cell_written_again_with_the_same_value_is_a_no_op(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=2)
    dock.put(0, [(0, 0), (1, 1)], {"reward": [0.25, 1.0], "ids": [np.arange(3), np.arange(4)]})
    dock.put(0, [(1, 1), (0, 0)], {"reward": [1.0, 0.25], "ids": [np.arange(4), np.arange(3)]})
    dock.put(0, [(1, 1), (1, 0)], {"reward": [1.0, 0.5]})
    assert dict(dock.table(0).written) == {"ids": 2, "reward": 3}
    assert dock.read(0, [(0, 0), (1, 0), (1, 1)], ["reward"]) == {"reward": [0.25, 0.5, 1.0]}


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (0.25, 0.5),
        ("yes", "no"),
        ({"a": 1}, {"a": 2}),
        (np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int32)),
        (np.arange(3, dtype=np.int32), np.array([0, 1, 3], dtype=np.int32)),
        (np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)),
        (np.arange(3, dtype=np.int32), [0, 1, 2]),
    ],
    ids=["float", "str", "dict", "array-shape", "array-values", "array-dtype", "array-vs-list"],
)
def test_a_cell_written_again_with_another_value_is_a_cell_conflict(
    dock: TransferDock, first: Value, second: Value
) -> None:
    dock.open(4, slots=2, group_size=2)
    dock.put(4, [(1, 0)], {"reward": [first]})
    with pytest.raises(CellConflictError, match=re.escape("column 'reward' of row (1, 0) in iteration 4")):
        dock.put(4, [(1, 0)], {"reward": [second]})
    [stored] = dock.read(4, [(1, 0)], ["reward"])["reward"]
    if isinstance(first, np.ndarray):
        assert isinstance(stored, np.ndarray) and stored.dtype == first.dtype and np.array_equal(stored, first)
    else:
        assert stored == first


def test_a_refused_put_writes_none_of_its_cells(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=1)
    dock.put(0, [(1, 0)], {"reward": [1.0]})
    with pytest.raises(CellConflictError, match=re.escape("column 'reward' of row (1, 0)")):
        dock.put(0, [(0, 0), (1, 0)], {"fresh": ["a", "b"], "reward": [0.0, 2.0]})
    with pytest.raises(DockInputError, match=re.escape("columns.bad[0]: not JSON-able")):
        dock.put(0, [(0, 0)], {"fresh": ["a"], "bad": [{1, 2}]})
    written = dock.table(0).written
    assert (written.get("fresh", 0), written.get("bad", 0), written["reward"]) == (0, 0, 1)
    with pytest.raises(CellsMissingError, match="column 'fresh' is not written"):
        dock.read(0, [(0, 0)], ["fresh"])
    assert dock.read(0, [(1, 0)], ["reward"]) == {"reward": [1.0]}


def test_read_of_unwritten_cells_never_waits_and_says_which(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=1)
    dock.put(0, [(1, 0)], {"score": [1.0]})
    with pytest.raises(
        CellsMissingError, match=re.escape("column 'score' is not written in 2 of the rows asked for")
    ) as caught:
        dock.read(0, all_rows(3, 1), ["score"])
    assert "(0, 0)" in str(caught.value) and "(2, 0)" in str(caught.value)
    with pytest.raises(CellsMissingError, match="column 'never'"):
        dock.read(0, [(1, 0)], ["score", "never"])
    assert dock.read(0, [(1, 0)], ["score"]) == {"score": [1.0]}


def test_read_with_missing_none_gives_none_for_unwritten_cells(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=1)
    dock.put(0, [(1, 0)], {"score": [1.0], "ids": [np.arange(3, dtype=np.int32)]})
    got = dock.read(0, all_rows(3, 1), ["score", "ids", "never"], missing="none")
    assert got["score"] == [None, 1.0, None]
    assert got["ids"][0] is None and got["ids"][2] is None
    np.testing.assert_array_equal(got["ids"][1], np.arange(3, dtype=np.int32))
    assert got["never"] == [None, None, None]
    with pytest.raises(DockInputError, match=r"^missing"):
        dock.read(0, [(1, 0)], ["score"], missing="skip")  # type: ignore[arg-type]


# --- dispatch -------------------------------------------------------------------------------------------------


def test_dispatch_hands_out_only_rows_whose_needed_columns_are_all_written(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=2)
    dock.register("reward", needs=["prompt", "response"], produces=["score"])
    dock.put(0, all_rows(3, 2), {"prompt": [f"p{n}" for n in range(6)]})
    dock.put(0, [(2, 1), (0, 1), (1, 0)], {"response": ["r21", "r01", "r10"]})
    dock.put(0, [(0, 0)], {"other": ["not needed"]})
    batch = dock.dispatch("reward", 100)
    assert (batch.consumer, batch.iteration) == ("reward", 0)
    assert batch.lease is not None and batch.expires_at is not None
    assert sorted(batch.rows) == [(0, 1), (1, 0), (2, 1)]
    assert len(batch) == 3
    assert set(batch.columns) == {"prompt", "response"}
    by_row = dict(zip(batch.rows, batch.columns["response"], strict=True))
    assert by_row == {(0, 1): "r01", (1, 0): "r10", (2, 1): "r21"}
    assert [batch.columns["prompt"][n] for n in range(3)] == [f"p{s * 2 + k}" for s, k in batch.rows]
    assert batch.parts == (tuple(range(3)),)


def test_a_leased_row_goes_to_one_dispatch_of_a_consumer_and_independently_to_another(dock: TransferDock) -> None:
    rows = ready_table(dock, slots=4, group_size=2)
    dock.register("critic", needs=["prompt"])
    first = dock.dispatch("scorer", 3)
    second = dock.dispatch("scorer", 3)
    third = dock.dispatch("scorer", 3)
    assert (len(first), len(second), len(third)) == (3, 3, 2)
    assert sorted([*first.rows, *second.rows, *third.rows]) == rows
    assert len({first.lease, second.lease, third.lease}) == 3
    empty = dock.dispatch("scorer", 3)
    assert (empty.lease, len(empty)) == (None, 0)
    other = dock.dispatch("critic", 100)
    assert sorted(other.rows) == rows


def test_an_empty_dispatch_has_no_lease(dock: TransferDock) -> None:
    dock.register("scorer", needs=["prompt"])
    nothing = dock.dispatch("scorer", 4)
    assert (nothing.lease, nothing.expires_at, nothing.rows, len(nothing)) == (None, None, (), 0)
    dock.open(0, slots=2, group_size=2)
    dock.put(0, [(0, 0)], {"response": ["not what it needs"]})
    for batch in (dock.dispatch("scorer", 4), dock.dispatch("scorer", 4, iteration=0)):
        assert (batch.lease, len(batch), batch.rows) == (None, 0, ())
        assert dict(batch.columns) == {}
    assert counts(dock, "scorer", 0) == (4, 0, 0, 0)


def test_dispatch_without_iteration_takes_the_oldest_table_with_a_ready_row(dock: TransferDock) -> None:
    dock.open(0, slots=1, group_size=2)
    dock.open(1, slots=1, group_size=2)
    dock.register("scorer", needs=["prompt"])
    dock.put(1, [(0, 0)], {"prompt": ["late"]})
    assert dock.dispatch("scorer", 4).iteration == 1
    dock.put(0, [(0, 1)], {"prompt": ["early"]})
    batch = dock.dispatch("scorer", 4)
    assert (batch.iteration, batch.rows, batch.columns["prompt"]) == (0, ((0, 1),), ["early"])
    assert dock.dispatch("scorer", 4, iteration=1).lease is None


def test_dispatch_takes_the_consumers_dispatch_size_when_count_is_not_given(dock: TransferDock) -> None:
    dock.open(0, slots=5, group_size=1)
    dock.register("sized", needs=["prompt"], dispatch_size=2)
    dock.register("unsized", needs=["prompt"])
    dock.put(0, all_rows(5, 1), {"prompt": list("abcde")})
    assert len(dock.dispatch("sized")) == 2
    assert len(dock.dispatch("sized", 3)) == 3
    with pytest.raises(DockInputError, match=re.escape("count: consumer 'unsized' has no dispatch_size")):
        dock.dispatch("unsized")


def test_a_roles_dispatch_size_from_the_batch_vocabulary_splits_the_step_among_its_readers(
    dock: TransferDock,
) -> None:
    # 4 prompts × 2 completions; the reference model on 2 DP ranks reads 4 pairs each, a rule reward the whole step.
    plan = derive_batch_plan(global_batch_size=4, mini_batch_size=4, num_generations=2, dp_size=2, micro_batch_size=2)
    dock.open(0, slots=4, group_size=2)
    dock.put(0, all_rows(4, 2), {"completion": [f"c{n}" for n in range(8)]})
    dock.register("ref", needs=["completion"], produces=["ref_logps"], dispatch_size=plan.dispatch_size("ref"))
    dock.register("reward", needs=["completion"], produces=["reward"], dispatch_size=plan.dispatch_size("reward"))
    first, second = dock.dispatch("ref"), dock.dispatch("ref")
    assert (len(first), len(second)) == (4, 4)
    assert set(first.rows).isdisjoint(second.rows)
    assert len(dock.dispatch("reward", groups=True)) == 8


def test_groups_hands_out_whole_groups_only_once_all_are_ready(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=4)
    dock.register("advantage", needs=["reward"], produces=["adv"])
    dock.put(0, [(0, k) for k in range(4)] + [(2, k) for k in range(4)], {"reward": [0.0] * 8})
    dock.put(0, [(1, 0), (1, 1), (1, 3)], {"reward": [1.0] * 3})
    batch = dock.dispatch("advantage", 12, groups=True)
    assert batch.rows == (*[(0, k) for k in range(4)], *[(2, k) for k in range(4)])
    assert dock.dispatch("advantage", 4, groups=True).lease is None
    # Slot 1's three written rows are ready row by row; only groups holds them back.
    assert counts(dock, "advantage", 0) == (12, 0, 8, 3)
    dock.put(0, [(1, 2)], {"reward": [1.0]})
    last = dock.dispatch("advantage", 4, groups=True)
    assert last.rows == tuple((1, k) for k in range(4))
    assert [len(b) for b in (batch, last)] == [8, 4]


def test_groups_takes_at_most_count_rows_of_whole_groups(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=2)
    dock.register("advantage", needs=["reward"])
    dock.put(0, all_rows(3, 2), {"reward": [0.0] * 6})
    assert dock.dispatch("advantage", 4, groups=True).rows == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert dock.dispatch("advantage", 4, groups=True).rows == ((2, 0), (2, 1))


def test_groups_with_a_count_off_the_group_size_is_refused(dock: TransferDock) -> None:
    dock.open(0, slots=3, group_size=4)
    dock.register("advantage", needs=["reward"])
    dock.put(0, all_rows(3, 4), {"reward": [0.0] * 12})
    with pytest.raises(DockInputError, match=re.escape("count: 6 is not a multiple of iteration 0's group_size 4")):
        dock.dispatch("advantage", 6, groups=True)
    assert counts(dock, "advantage", 0) == (12, 0, 0, 12)


@pytest.mark.parametrize(("n", "dp_size"), [(10, 3), (8, 2), (5, 5), (3, 4), (7, 1)])
def test_dp_size_splits_the_rows_into_near_equal_parts(dock: TransferDock, n: int, dp_size: int) -> None:
    dock.open(0, slots=n, group_size=1)
    dock.register("actor", needs=["prompt"])
    dock.put(0, all_rows(n, 1), {"prompt": [str(i) for i in range(n)]})
    batch = dock.dispatch("actor", n, dp_size=dp_size)
    assert len(batch.parts) == dp_size
    assert covered_once(batch.parts, n)
    sizes = [len(p) for p in batch.parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("slots", "group_size", "dp_size"), [(4, 3, 2), (4, 3, 3), (5, 2, 2), (2, 4, 2), (3, 2, 4)])
def test_dp_size_with_groups_keeps_each_group_in_one_part(
    dock: TransferDock, slots: int, group_size: int, dp_size: int
) -> None:
    dock.open(0, slots=slots, group_size=group_size)
    dock.register("actor", needs=["prompt"])
    dock.put(0, all_rows(slots, group_size), {"prompt": ["p"] * (slots * group_size)})
    batch = dock.dispatch("actor", slots * group_size, groups=True, dp_size=dp_size)
    assert len(batch.parts) == dp_size
    assert covered_once(batch.parts, len(batch))
    part_of_slot: dict[int, set[int]] = {}
    for r, part in enumerate(batch.parts):
        for position in part:
            part_of_slot.setdefault(batch.rows[position][0], set()).add(r)
        assert len(part) % group_size == 0
    assert all(len(parts) == 1 for parts in part_of_slot.values())
    groups_per_part = [len(p) // group_size for p in batch.parts]
    assert max(groups_per_part) - min(groups_per_part) <= 1


def best_padded_load(lengths: list[int], dp_size: int) -> int:
    """The least, over every split of the rows among the readers, of the largest part's rows × longest row."""
    best = None
    for owners in itertools.product(range(dp_size), repeat=len(lengths)):
        parts = [[n for n, o in enumerate(owners) if o == r] for r in range(dp_size)]
        load = max((len(p) * max(lengths[n] for n in p) if p else 0) for p in parts)
        best = load if best is None else min(best, load)
    assert best is not None
    return best


@pytest.mark.parametrize("lengths", [[1, 2, 3, 4, 5, 6, 7, 8], [5, 1, 8, 3, 7, 2, 6, 4], [4, 4, 4, 4, 4, 4]])
def test_balance_by_splits_by_tokens(dock: TransferDock, lengths: list[int]) -> None:
    n = len(lengths)
    dock.open(0, slots=n, group_size=1)
    dock.register("actor", needs=["prompt", "ids"])
    dock.put(0, all_rows(n, 1), {"prompt": ["p"] * n, "ids": [np.full(m, 7, dtype=np.int32) for m in lengths]})
    batch = dock.dispatch("actor", n, dp_size=2, balance_by="ids")
    assert len(batch.parts) == 2
    assert covered_once(batch.parts, n)
    by_position = [len(ids) for ids in batch.columns["ids"]]
    assert sorted(by_position) == sorted(lengths)
    # The planner balances the tokens each reader computes (rows × longest row, as padded): that load is optimal
    # here, and the real token sums stay within one row's length of each other.
    padded = [len(p) * max(by_position[i] for i in p) for p in batch.parts]
    assert max(padded) == best_padded_load(by_position, 2)
    sums = [sum(by_position[i] for i in p) for p in batch.parts]
    assert abs(sums[0] - sums[1]) <= max(lengths)


def test_balance_by_an_integer_column_and_under_a_token_cap(dock: TransferDock) -> None:
    lengths = [9, 3, 6, 2, 8, 4]
    dock.open(0, slots=6, group_size=1)
    dock.register("actor", needs=["length"])
    dock.put(0, all_rows(6, 1), {"length": lengths})
    batch = dock.dispatch("actor", 6, dp_size=2, balance_by="length", max_tokens_per_microbatch=10)
    assert covered_once(batch.parts, 6)
    assert batch.columns["length"] == lengths


def test_balance_by_a_text_column_is_refused_and_claims_nothing(dock: TransferDock) -> None:
    ready_table(dock, slots=2, group_size=1)
    with pytest.raises(DockInputError, match=re.escape("balance_by: row 0 has 'p0.0' there")):
        dock.dispatch("scorer", 2, dp_size=2, balance_by="prompt")
    assert counts(dock, "scorer", 0) == (2, 0, 0, 2)


# --- collect and consumption ----------------------------------------------------------------------------------


def test_collect_marks_rows_consumed_and_consumption_follows_each_step(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=2)
    dock.register("scorer", needs=["prompt"], produces=["score"])
    assert counts(dock, "scorer", 0) == (4, 0, 0, 0)
    dock.put(0, all_rows(2, 2), {"prompt": ["a", "b", "c", "d"]})
    assert counts(dock, "scorer", 0) == (4, 0, 0, 4)
    batch = dock.dispatch("scorer", 3)
    assert batch.lease is not None
    assert counts(dock, "scorer", 0) == (4, 0, 3, 1)
    assert dock.collect(batch.lease, {"score": [0.0, 0.5, 1.0]}) == Collected("scorer", 0, batch.rows)
    assert counts(dock, "scorer", 0) == (4, 3, 0, 1)
    assert dock.read(0, list(batch.rows), ["score"]) == {"score": [0.0, 0.5, 1.0]}
    assert dict(dock.table(0).written) == {"prompt": 4, "score": 3}
    assert not dock.all_consumed("scorer", 0)
    last = dock.dispatch("scorer", 3)
    assert last.lease is not None and len(last) == 1
    assert counts(dock, "scorer", 0) == (4, 3, 1, 0)
    dock.collect(last.lease, {"score": [2.0]})
    status = dock.consumption("scorer", 0)
    assert status == Consumption("scorer", 0, 4, 4, 0, 0)
    assert status.all_consumed and dock.all_consumed("scorer", 0)
    assert dock.dispatch("scorer", 3).lease is None


def test_a_consumer_that_produces_nothing_collects_an_empty_mapping(dock: TransferDock) -> None:
    dock.open(0, slots=2, group_size=1)
    dock.register("logger", needs=["prompt"])
    dock.put(0, all_rows(2, 1), {"prompt": ["a", "b"]})
    batch = dock.dispatch("logger", 2)
    assert batch.lease is not None
    dock.collect(batch.lease, {})
    assert dock.all_consumed("logger", 0)
    assert dict(dock.table(0).written) == {"prompt": 2}


def test_collect_again_with_the_same_values_is_a_no_op_and_with_others_a_conflict(dock: TransferDock) -> None:
    ready_table(dock, slots=2, group_size=1)
    batch = dock.dispatch("scorer", 2)
    assert batch.lease is not None
    dock.collect(batch.lease, {"score": [0.25, 0.75]})
    dock.collect(batch.lease, {"score": [0.25, 0.75]})
    assert counts(dock, "scorer", 0) == (2, 2, 0, 0)
    with pytest.raises(CellConflictError, match="column 'score' of row"):
        dock.collect(batch.lease, {"score": [0.25, 0.5]})
    assert dock.read(0, list(batch.rows), ["score"]) == {"score": [0.25, 0.75]}
    assert counts(dock, "scorer", 0) == (2, 2, 0, 0)


def test_collect_of_a_column_the_consumer_does_not_produce_is_refused(dock: TransferDock) -> None:
    ready_table(dock, slots=2, group_size=1)
    batch = dock.dispatch("scorer", 2)
    assert batch.lease is not None
    with pytest.raises(
        DockInputError,
        match=re.escape("columns: consumer 'scorer' does not produce ['advantage']; it produces ['score']"),
    ):
        dock.collect(batch.lease, {"score": [1.0, 1.0], "advantage": [0.0, 0.0]})
    assert counts(dock, "scorer", 0) == (2, 0, 2, 0)
    assert "score" not in dock.table(0).written
    dock.collect(batch.lease, {"score": [1.0, 1.0]})
    assert dock.all_consumed("scorer", 0)


def test_collect_with_the_wrong_number_of_values_is_refused_and_the_lease_stays(dock: TransferDock) -> None:
    ready_table(dock, slots=3, group_size=1)
    batch = dock.dispatch("scorer", 3)
    assert batch.lease is not None
    with pytest.raises(DockInputError, match=re.escape("columns.score: 2 values for 3 rows")):
        dock.collect(batch.lease, {"score": [1.0, 2.0]})
    assert counts(dock, "scorer", 0) == (3, 0, 3, 0)
    dock.collect(batch.lease, {"score": [1.0, 2.0, 3.0]})
    assert counts(dock, "scorer", 0) == (3, 3, 0, 0)


def test_collect_of_an_unknown_lease_is_a_lease_error(dock: TransferDock) -> None:
    ready_table(dock, slots=1, group_size=1)
    with pytest.raises(LeaseError, match="is unknown"):
        dock.collect("0123456789abcdef0123456789abcdef", {"score": [1.0]})


def test_an_expired_lease_returns_its_rows_and_its_late_collect_is_refused(dock: TransferDock) -> None:
    ready_table(dock, slots=2, group_size=2)
    late = dock.dispatch("scorer", 3, lease_s=SHORT_LEASE_S)
    assert late.lease is not None
    time.sleep(PAST_SHORT_LEASE_S)
    assert counts(dock, "scorer", 0) == (4, 0, 0, 4)
    again = dock.dispatch("scorer", 3)
    assert again.lease is not None and again.lease != late.lease
    assert again.rows == late.rows
    with pytest.raises(LeaseError, match="expired") as caught:
        dock.collect(late.lease, {"score": [9.0, 9.0, 9.0]})
    assert "scorer" in str(caught.value)
    with pytest.raises(LeaseError, match="expired"):
        dock.renew(late.lease, 30.0)
    dock.collect(again.lease, {"score": [1.0, 2.0, 3.0]})
    assert dock.read(0, list(again.rows), ["score"]) == {"score": [1.0, 2.0, 3.0]}
    assert counts(dock, "scorer", 0) == (4, 3, 0, 1)


def test_an_expired_lease_is_refused_even_when_nobody_took_its_rows(dock: TransferDock) -> None:
    ready_table(dock, slots=1, group_size=2)
    batch = dock.dispatch("scorer", 2, lease_s=SHORT_LEASE_S)
    assert batch.lease is not None
    time.sleep(PAST_SHORT_LEASE_S)
    with pytest.raises(LeaseError, match="expired"):
        dock.collect(batch.lease, {"score": [1.0, 1.0]})
    assert counts(dock, "scorer", 0) == (2, 0, 0, 2)
    assert "score" not in dock.table(0).written


def test_renew_extends_a_lease_past_its_first_expiry(dock: TransferDock) -> None:
    ready_table(dock, slots=2, group_size=1)
    batch = dock.dispatch("scorer", 2, lease_s=0.5)
    assert batch.lease is not None and batch.expires_at is not None
    expires_at = dock.renew(batch.lease, 30.0)
    assert expires_at > batch.expires_at
    time.sleep(0.65)
    assert counts(dock, "scorer", 0) == (2, 0, 2, 0)
    assert dock.dispatch("scorer", 2).lease is None
    dock.collect(batch.lease, {"score": [1.0, 0.0]})
    assert dock.all_consumed("scorer", 0)
    with pytest.raises(LeaseError, match="already collected"):
        dock.renew(batch.lease, 30.0)


def test_renew_with_a_bad_lease_s_is_refused(dock: TransferDock) -> None:
    ready_table(dock, slots=1, group_size=1)
    batch = dock.dispatch("scorer", 1)
    assert batch.lease is not None
    for lease_s in (0.0, -1.0, 1e9):
        with pytest.raises(DockInputError, match=r"^lease_s: "):
            dock.renew(batch.lease, lease_s)
    with pytest.raises(LeaseError, match="is unknown"):
        dock.renew("0123456789abcdef0123456789abcdef", 30.0)


def test_all_consumed_only_after_every_row_is_collected_and_per_consumer(dock: TransferDock) -> None:
    ready_table(dock, slots=3, group_size=1)
    dock.register("critic", needs=["prompt"])
    for _ in range(3):
        assert not dock.all_consumed("scorer", 0)
        batch = dock.dispatch("scorer", 1)
        assert batch.lease is not None
        assert not dock.all_consumed("scorer", 0)
        dock.collect(batch.lease, {"score": [0.0]})
    assert dock.all_consumed("scorer", 0)
    assert not dock.all_consumed("critic", 0)
    assert counts(dock, "critic", 0) == (3, 0, 0, 3)


# --- consume --------------------------------------------------------------------------------------------------


def test_consume_processes_every_row_exactly_once(dock: TransferDock) -> None:
    rows = ready_table(dock, slots=4, group_size=2)
    seen: list[RowKey] = []
    sizes: list[int] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        seen.extend(batch.rows)
        sizes.append(len(batch))
        return {"score": [float(len(p)) for p in batch.columns["prompt"]]}

    assert consume(dock, "scorer", 0, work, count=3) == 8
    assert sorted(seen) == rows
    assert sizes == [3, 3, 2]
    assert dock.all_consumed("scorer", 0)
    assert dock.read(0, rows, ["score"]) == {"score": [4.0] * 8}
    assert consume(dock, "scorer", 0, work, count=3) == 0


def test_consume_with_groups_hands_whole_groups(dock: TransferDock) -> None:
    ready_table(dock, slots=3, group_size=2)
    batches: list[tuple[RowKey, ...]] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        batches.append(batch.rows)
        return {"score": [1.0] * len(batch)}

    assert consume(dock, "scorer", 0, work, count=4, groups=True) == 6
    assert batches == [((0, 0), (0, 1), (1, 0), (1, 1)), ((2, 0), (2, 1))]


def test_consume_waits_for_rows_written_while_it_runs(dock: TransferDock) -> None:
    dock.open(0, slots=4, group_size=1)
    dock.register("scorer", needs=["prompt"], produces=["score"])
    dock.put(0, [(0, 0), (1, 0)], {"prompt": ["a", "b"]})
    seen: list[RowKey] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        seen.extend(batch.rows)
        if len(seen) == 2:
            threading.Timer(0.1, lambda: dock.put(0, [(2, 0), (3, 0)], {"prompt": ["c", "d"]})).start()
        return {"score": [1.0] * len(batch)}

    assert consume(dock, "scorer", 0, work, count=2, poll_s=0.02, timeout_s=30.0) == 4
    assert sorted(seen) == all_rows(4, 1)


def test_consume_times_out_when_nothing_becomes_ready(dock: TransferDock) -> None:
    dock.open(0, slots=1, group_size=1)
    dock.register("scorer", needs=["prompt"], produces=["score"])
    with pytest.raises(TimeoutError, match="is the producer of its columns running"):
        consume(dock, "scorer", 0, lambda batch: {"score": []}, count=1, poll_s=0.02, timeout_s=0.1)


# --- bad inputs -----------------------------------------------------------------------------------------------

BAD_INPUTS: list[tuple[str, Callable[[TransferDock], object], str]] = [
    (
        "row-slot-out-of-range",
        lambda d: d.put(0, [(2, 0)], {"y": [1]}),
        "rows[0]: (2, 0) is outside iteration 0's table",
    ),
    ("row-index-out-of-range", lambda d: d.put(0, [(0, 0), (1, 2)], {"y": [1, 2]}), "rows[1]: (1, 2) is outside"),
    ("row-negative", lambda d: d.read(0, [(-1, 0)], ["x"]), "rows[0]: (-1, 0) is outside"),
    ("rows-duplicate", lambda d: d.put(0, [(0, 1), (0, 1)], {"y": [1, 1]}), "rows: a row appears twice"),
    ("values-too-many", lambda d: d.put(0, [(0, 0)], {"y": [1, 2]}), "columns.y: 2 values for 1 rows"),
    ("values-too-few", lambda d: d.put(0, [(0, 0), (1, 0)], {"y": [1]}), "columns.y: 1 values for 2 rows"),
    ("column-name-upper", lambda d: d.put(0, [(0, 0)], {"Bad": [1]}), "columns.Bad: 'Bad' is not a name"),
    ("column-name-space", lambda d: d.put(0, [(0, 0)], {"a b": [1]}), "columns.a b: 'a b' is not a name"),
    ("column-name-empty", lambda d: d.put(0, [(0, 0)], {"": [1]}), "columns.: '' is not a name"),
    ("value-set", lambda d: d.put(0, [(0, 0)], {"y": [{1, 2}]}), "columns.y[0]: not JSON-able"),
    ("value-nan", lambda d: d.put(0, [(0, 0), (1, 0)], {"y": [1.0, float("nan")]}), "columns.y[1]: not JSON-able"),
    ("read-column-name", lambda d: d.read(0, [(0, 0)], ["x", "X"]), "columns[1]: 'X' is not a name"),
    ("count-0", lambda d: d.dispatch("reader", 0), "count: 0 is outside"),
    ("count-negative", lambda d: d.dispatch("reader", -2), "count: -2 is outside"),
    ("lease_s-0", lambda d: d.dispatch("reader", 1, lease_s=0), "lease_s: 0 is outside"),
    ("lease_s-negative", lambda d: d.dispatch("reader", 1, lease_s=-1.0), "lease_s: -1.0 is outside"),
    ("dp_size-0", lambda d: d.dispatch("reader", 1, dp_size=0), "dp_size: 0 is outside"),
    (
        "groups-and-balance_by",
        lambda d: d.dispatch("reader", 2, groups=True, balance_by="x"),
        "balance_by: groups keeps",
    ),
    ("balance_by-not-needed", lambda d: d.dispatch("reader", 2, balance_by="y"), "balance_by: 'y' is not among"),
    ("register-name", lambda d: d.register("Reader", needs=["x"]), "name: 'Reader' is not a name"),
    ("register-name-long", lambda d: d.register("r" * 65, needs=["x"]), "name: 'rrr"),
    ("register-no-needs", lambda d: d.register("empty", needs=[]), "needs: a consumer needs at least one column"),
    ("register-need-name", lambda d: d.register("other", needs=["x", "Y"]), "needs[1]: 'Y' is not a name"),
    ("register-produce-name", lambda d: d.register("other", needs=["x"], produces=["a/b"]), "produces[0]: 'a/b'"),
    (
        "register-dispatch_size",
        lambda d: d.register("other", needs=["x"], dispatch_size=0),
        "dispatch_size: 0 is outside",
    ),
    ("open-slots-0", lambda d: d.open(1, slots=0, group_size=2), "slots: 0 is outside"),
    ("open-group_size-0", lambda d: d.open(1, slots=2, group_size=0), "group_size: 0 is outside"),
    (
        "open-iteration-too-low",
        lambda d: d.open(-(2**62) - 1, slots=2, group_size=2),
        "iteration: -4611686018427387905 is outside",
    ),
]


@pytest.mark.parametrize(("call", "message"), [(c, m) for _, c, m in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
def test_a_bad_input_is_refused_naming_its_field_and_changes_nothing(
    dock: TransferDock, call: Callable[[TransferDock], object], message: str
) -> None:
    dock.open(0, slots=2, group_size=2)
    dock.register("reader", needs=["x"])
    dock.put(0, all_rows(2, 2), {"x": [1, 2, 3, 4]})
    # Over HTTP a value outside the wire schema's bounds is refused by the schema, in its own words: the
    # message still starts with the field.
    expected = message if isinstance(dock, TransferDock) else message.split(":")[0]
    with pytest.raises(DockInputError, match="^" + re.escape(expected)):
        call(dock)
    assert [t.iteration for t in dock.tables()] == [0]
    assert dict(dock.table(0).written) == {"x": 4}
    assert [c.name for c in registered(dock)] == ["reader"]
    assert counts(dock, "reader", 0) == (4, 0, 0, 4)
