"""``ExperienceStore``'s behaviour through its public methods: tables, consumers, write-once cells, reads by index,
dispatch (readiness, leases, groups, data-parallel parts, token balance), collect, lease expiry and renewal,
consumption, ``consume``, and the errors of bad inputs.

Only public methods of the store and ``proctor.experience.consume`` are used, so the same tests can run against the
HTTP client. Leases expire on the real clock: a short lease, then a sleep past it.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from proctor.batching.vocabulary import derive_batch_plan
from proctor.experience import (
    CellConflictError,
    CellsMissingError,
    Collected,
    Consumer,
    Consumption,
    Dispatch,
    ExperienceInputError,
    ExperienceStore,
    LeaseError,
    RowKey,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
    Value,
    consume,
)
from proctor.experience.columns import GRADER

SHORT_LEASE_S = 0.3
PAST_SHORT_LEASE_S = 0.45


def all_rows(slots: int, group_size: int) -> list[RowKey]:
    return [(s, k) for s in range(slots) for k in range(group_size)]


def registered(experience: ExperienceStore) -> list[Consumer]:
    """The consumers a test registered: the dataserver registers its own grader role as it starts."""
    return [c for c in experience.consumers() if c != GRADER]


def covered_once(parts: Sequence[Sequence[int]], n: int) -> bool:
    flat = [p for part in parts for p in part]
    return sorted(flat) == list(range(n))


def ready_table(experience: ExperienceStore, slots: int = 4, group_size: int = 2, iteration: int = 0) -> list[RowKey]:
    """A table whose ``prompt`` column is written in every row, and a consumer ``scorer`` that needs it."""
    rows = all_rows(slots, group_size)
    experience.open(iteration, slots=slots, group_size=group_size)
    experience.register("scorer", needs=["prompt"], produces=["score"])
    experience.put(iteration, rows, {"prompt": [f"p{s}.{k}" for s, k in rows]})
    return rows


def counts(experience: ExperienceStore, consumer: str, iteration: int) -> tuple[int, int, int, int]:
    c = experience.consumption(consumer, iteration)
    return (c.rows, c.consumed, c.held, c.ready)


# --- tables ---------------------------------------------------------------------------------------------------


def test_open_returns_the_shape_and_is_idempotent(experience: ExperienceStore) -> None:
    info = experience.open(3, slots=4, group_size=2)
    assert (info.iteration, info.slots, info.group_size, info.rows) == (3, 4, 2, 8)
    assert dict(info.written) == {}
    again = experience.open(3, slots=4, group_size=2)
    assert (again.iteration, again.slots, again.group_size, dict(again.written)) == (3, 4, 2, {})
    assert [t.iteration for t in experience.tables()] == [3]
    assert experience.table(3).rows == 8


def test_open_again_keeps_what_was_written(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=2)
    experience.put(0, [(0, 0), (1, 1)], {"prompt": ["a", "b"]})
    assert dict(experience.open(0, slots=2, group_size=2).written) == {"prompt": 2}


def test_open_with_another_shape_is_a_shape_conflict_naming_both(experience: ExperienceStore) -> None:
    experience.open(1, slots=4, group_size=2)
    with pytest.raises(ShapeConflictError) as caught:
        experience.open(1, slots=5, group_size=3)
    message = str(caught.value)
    assert "4 slots × group_size 2" in message
    assert "5 × 3" in message
    assert experience.table(1).slots == 4


def test_tables_are_listed_oldest_first_with_written_counts(experience: ExperienceStore) -> None:
    for iteration in (5, 2, 7):
        experience.open(iteration, slots=2, group_size=3)
    experience.put(5, [(0, 0), (0, 1), (1, 2)], {"prompt": ["a", "b", "c"]})
    experience.put(5, [(1, 0)], {"reward": [1.0]})
    assert [t.iteration for t in experience.tables()] == [2, 5, 7]
    assert dict(experience.table(5).written) == {"prompt": 3, "reward": 1}
    assert dict(experience.table(2).written) == {}


def test_unknown_iteration_is_refused_by_every_call_that_names_one(experience: ExperienceStore) -> None:
    with pytest.raises(UnknownIterationError, match="iteration 9 has no table"):
        experience.table(9)
    experience.open(0, slots=1, group_size=1)
    experience.register("scorer", needs=["prompt"])
    calls: list[Callable[[], object]] = [
        lambda: experience.table(9),
        lambda: experience.put(9, [(0, 0)], {"prompt": ["a"]}),
        lambda: experience.read(9, [(0, 0)], ["prompt"]),
        lambda: experience.dispatch("scorer", 1, iteration=9),
        lambda: experience.consumption("scorer", 9),
        lambda: experience.all_consumed("scorer", 9),
    ]
    for call in calls:
        with pytest.raises(UnknownIterationError, match=r"iteration 9 has no table \(kept: 0\.\.0\)"):
            call()


# --- consumers ------------------------------------------------------------------------------------------------


def test_register_returns_the_consumer_and_is_idempotent(experience: ExperienceStore) -> None:
    first = experience.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4)
    assert first == Consumer("reward", ("prompt", "response"), ("score",), 4)
    assert experience.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4) == first
    experience.register("actor", needs=["prompt"])
    assert [c.name for c in registered(experience)] == ["actor", "reward"]
    assert registered(experience)[0] == Consumer("actor", ("prompt",), (), None)


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
def test_register_with_other_columns_is_a_shape_conflict(experience: ExperienceStore, changed: dict[str, Any]) -> None:
    experience.register("reward", needs=["prompt", "response"], produces=["score"], dispatch_size=4)
    with pytest.raises(
        ShapeConflictError, match=re.escape("consumer 'reward' is registered as needs=['prompt', 'response']")
    ):
        experience.register("reward", **changed)
    assert registered(experience) == [Consumer("reward", ("prompt", "response"), ("score",), 4)]


def test_unknown_consumer_is_refused(experience: ExperienceStore) -> None:
    experience.open(0, slots=1, group_size=1)
    calls: list[Callable[[], object]] = [
        lambda: experience.dispatch("nobody", 1),
        lambda: experience.consumption("nobody", 0),
        lambda: experience.all_consumed("nobody", 0),
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


def test_put_and_read_round_trip_json_values(experience: ExperienceStore) -> None:
    experience.open(0, slots=len(JSON_VALUES), group_size=1)
    rows = all_rows(len(JSON_VALUES), 1)
    experience.put(0, rows, {"value": JSON_VALUES})
    assert experience.read(0, rows, ["value"]) == {"value": JSON_VALUES}
    assert experience.read(0, rows[::-1], ["value"]) == {"value": JSON_VALUES[::-1]}


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
def test_put_and_read_round_trip_arrays(experience: ExperienceStore, array: np.ndarray[Any, Any]) -> None:
    experience.open(0, slots=2, group_size=1)
    other = np.ones(3, dtype=array.dtype)
    experience.put(0, [(0, 0), (1, 0)], {"tokens": [array, other]})
    got = experience.read(0, [(1, 0), (0, 0)], ["tokens"])["tokens"]
    for value, expected in zip(got, [other, array], strict=True):
        assert isinstance(value, np.ndarray)
        assert value.dtype == expected.dtype
        assert value.shape == expected.shape
        assert np.array_equal(value, expected)


def test_read_several_columns_in_the_order_of_the_rows_asked(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=2)
    rows = all_rows(2, 2)
    experience.put(0, rows, {"text": ["a", "b", "c", "d"], "ids": [np.arange(n, dtype=np.int32) for n in range(1, 5)]})
    got = experience.read(0, [(1, 1), (0, 0)], ["text", "ids"])
    assert got["text"] == ["d", "a"]
    assert [len(v) for v in got["ids"]] == [4, 1]


def test_a_cell_written_again_with_the_same_value_is_a_no_op(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=2)
    experience.put(0, [(0, 0), (1, 1)], {"reward": [0.25, 1.0], "ids": [np.arange(3), np.arange(4)]})
    experience.put(0, [(1, 1), (0, 0)], {"reward": [1.0, 0.25], "ids": [np.arange(4), np.arange(3)]})
    experience.put(0, [(1, 1), (1, 0)], {"reward": [1.0, 0.5]})
    assert dict(experience.table(0).written) == {"ids": 2, "reward": 3}
    assert experience.read(0, [(0, 0), (1, 0), (1, 1)], ["reward"]) == {"reward": [0.25, 0.5, 1.0]}


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
    experience: ExperienceStore, first: Value, second: Value
) -> None:
    experience.open(4, slots=2, group_size=2)
    experience.put(4, [(1, 0)], {"reward": [first]})
    with pytest.raises(CellConflictError, match=re.escape("column 'reward' of row (1, 0) in iteration 4")):
        experience.put(4, [(1, 0)], {"reward": [second]})
    [stored] = experience.read(4, [(1, 0)], ["reward"])["reward"]
    if isinstance(first, np.ndarray):
        assert isinstance(stored, np.ndarray) and stored.dtype == first.dtype and np.array_equal(stored, first)
    else:
        assert stored == first


def test_a_refused_put_writes_none_of_its_cells(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=1)
    experience.put(0, [(1, 0)], {"reward": [1.0]})
    with pytest.raises(CellConflictError, match=re.escape("column 'reward' of row (1, 0)")):
        experience.put(0, [(0, 0), (1, 0)], {"fresh": ["a", "b"], "reward": [0.0, 2.0]})
    with pytest.raises(ExperienceInputError, match=re.escape("columns.bad[0]: not JSON-able")):
        experience.put(0, [(0, 0)], {"fresh": ["a"], "bad": [{1, 2}]})
    written = experience.table(0).written
    assert (written.get("fresh", 0), written.get("bad", 0), written["reward"]) == (0, 0, 1)
    with pytest.raises(CellsMissingError, match="column 'fresh' is not written"):
        experience.read(0, [(0, 0)], ["fresh"])
    assert experience.read(0, [(1, 0)], ["reward"]) == {"reward": [1.0]}


def test_read_of_unwritten_cells_never_waits_and_says_which(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=1)
    experience.put(0, [(1, 0)], {"score": [1.0]})
    with pytest.raises(
        CellsMissingError, match=re.escape("column 'score' is not written in 2 of the rows asked for")
    ) as caught:
        experience.read(0, all_rows(3, 1), ["score"])
    assert "(0, 0)" in str(caught.value) and "(2, 0)" in str(caught.value)
    with pytest.raises(CellsMissingError, match="column 'never'"):
        experience.read(0, [(1, 0)], ["score", "never"])
    assert experience.read(0, [(1, 0)], ["score"]) == {"score": [1.0]}


def test_read_with_missing_none_gives_none_for_unwritten_cells(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=1)
    experience.put(0, [(1, 0)], {"score": [1.0], "ids": [np.arange(3, dtype=np.int32)]})
    got = experience.read(0, all_rows(3, 1), ["score", "ids", "never"], missing="none")
    assert got["score"] == [None, 1.0, None]
    assert got["ids"][0] is None and got["ids"][2] is None
    np.testing.assert_array_equal(got["ids"][1], np.arange(3, dtype=np.int32))
    assert got["never"] == [None, None, None]
    with pytest.raises(ExperienceInputError, match=r"^missing"):
        experience.read(0, [(1, 0)], ["score"], missing="skip")  # type: ignore[arg-type]


# --- dispatch -------------------------------------------------------------------------------------------------


def test_dispatch_hands_out_only_rows_whose_needed_columns_are_all_written(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=2)
    experience.register("reward", needs=["prompt", "response"], produces=["score"])
    experience.put(0, all_rows(3, 2), {"prompt": [f"p{n}" for n in range(6)]})
    experience.put(0, [(2, 1), (0, 1), (1, 0)], {"response": ["r21", "r01", "r10"]})
    experience.put(0, [(0, 0)], {"other": ["not needed"]})
    batch = experience.dispatch("reward", 100)
    assert (batch.consumer, batch.iteration) == ("reward", 0)
    assert batch.lease is not None and batch.expires_at is not None
    assert sorted(batch.rows) == [(0, 1), (1, 0), (2, 1)]
    assert len(batch) == 3
    assert set(batch.columns) == {"prompt", "response"}
    by_row = dict(zip(batch.rows, batch.columns["response"], strict=True))
    assert by_row == {(0, 1): "r01", (1, 0): "r10", (2, 1): "r21"}
    assert [batch.columns["prompt"][n] for n in range(3)] == [f"p{s * 2 + k}" for s, k in batch.rows]
    assert batch.parts == (tuple(range(3)),)


def test_a_leased_row_goes_to_one_dispatch_of_a_consumer_and_independently_to_another(
    experience: ExperienceStore,
) -> None:
    rows = ready_table(experience, slots=4, group_size=2)
    experience.register("critic", needs=["prompt"])
    first = experience.dispatch("scorer", 3)
    second = experience.dispatch("scorer", 3)
    third = experience.dispatch("scorer", 3)
    assert (len(first), len(second), len(third)) == (3, 3, 2)
    assert sorted([*first.rows, *second.rows, *third.rows]) == rows
    assert len({first.lease, second.lease, third.lease}) == 3
    empty = experience.dispatch("scorer", 3)
    assert (empty.lease, len(empty)) == (None, 0)
    other = experience.dispatch("critic", 100)
    assert sorted(other.rows) == rows


def test_an_empty_dispatch_has_no_lease(experience: ExperienceStore) -> None:
    experience.register("scorer", needs=["prompt"])
    nothing = experience.dispatch("scorer", 4)
    assert (nothing.lease, nothing.expires_at, nothing.rows, len(nothing)) == (None, None, (), 0)
    experience.open(0, slots=2, group_size=2)
    experience.put(0, [(0, 0)], {"response": ["not what it needs"]})
    for batch in (experience.dispatch("scorer", 4), experience.dispatch("scorer", 4, iteration=0)):
        assert (batch.lease, len(batch), batch.rows) == (None, 0, ())
        assert dict(batch.columns) == {}
    assert counts(experience, "scorer", 0) == (4, 0, 0, 0)


def test_a_waiting_dispatch_takes_rows_written_while_it_waits(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=1)
    experience.register("scorer", needs=["prompt"])
    assert experience.dispatch("scorer", 4, wait_s=0.2).lease is None  # nothing came: empty after the wait
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(experience.dispatch, "scorer", 4, wait_s=30)
        time.sleep(0.2)  # so that the dispatch is waiting when the rows come
        experience.put(0, [(0, 0), (1, 0)], {"prompt": ["a", "b"]})
        batch = waiting.result(timeout=60)
    assert batch.lease is not None
    assert sorted(batch.rows) == [(0, 0), (1, 0)]


def test_the_next_dispatch_of_a_collection_waits_for_rows_written_after_it(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=1)
    experience.register("scorer", needs=["prompt"], produces=["score"])
    experience.put(0, [(0, 0)], {"prompt": ["a"]})
    batch = experience.dispatch("scorer", 1)
    assert batch.lease is not None
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(experience.collect_and_dispatch, batch.lease, {"score": [1.0]}, 1, wait_s=30)
        deadline = time.monotonic() + 60
        while counts(experience, "scorer", 0)[1] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the collection is stored; its dispatch found nothing and waits
        experience.put(0, [(1, 0)], {"prompt": ["b"]})
        collected, nxt = waiting.result(timeout=60)
    assert collected.rows == ((0, 0),)
    assert nxt.lease is not None and nxt.rows == ((1, 0),)


def test_dispatch_without_iteration_takes_the_oldest_table_with_a_ready_row(experience: ExperienceStore) -> None:
    experience.open(0, slots=1, group_size=2)
    experience.open(1, slots=1, group_size=2)
    experience.register("scorer", needs=["prompt"])
    experience.put(1, [(0, 0)], {"prompt": ["late"]})
    assert experience.dispatch("scorer", 4).iteration == 1
    experience.put(0, [(0, 1)], {"prompt": ["early"]})
    batch = experience.dispatch("scorer", 4)
    assert (batch.iteration, batch.rows, batch.columns["prompt"]) == (0, ((0, 1),), ["early"])
    assert experience.dispatch("scorer", 4, iteration=1).lease is None


def test_dispatch_takes_the_consumers_dispatch_size_when_count_is_not_given(experience: ExperienceStore) -> None:
    experience.open(0, slots=5, group_size=1)
    experience.register("sized", needs=["prompt"], dispatch_size=2)
    experience.register("unsized", needs=["prompt"])
    experience.put(0, all_rows(5, 1), {"prompt": list("abcde")})
    assert len(experience.dispatch("sized")) == 2
    assert len(experience.dispatch("sized", 3)) == 3
    with pytest.raises(ExperienceInputError, match=re.escape("count: consumer 'unsized' has no dispatch_size")):
        experience.dispatch("unsized")


def test_a_roles_dispatch_size_from_the_batch_vocabulary_splits_the_step_among_its_readers(
    experience: ExperienceStore,
) -> None:
    # 4 prompts × 2 completions; the reference model on 2 DP ranks reads 4 pairs each, a rule reward the whole step.
    plan = derive_batch_plan(global_batch_size=4, mini_batch_size=4, num_generations=2, dp_size=2, micro_batch_size=2)
    experience.open(0, slots=4, group_size=2)
    experience.put(0, all_rows(4, 2), {"completion": [f"c{n}" for n in range(8)]})
    experience.register("ref", needs=["completion"], produces=["ref_logps"], dispatch_size=plan.dispatch_size("ref"))
    experience.register("reward", needs=["completion"], produces=["reward"], dispatch_size=plan.dispatch_size("reward"))
    first, second = experience.dispatch("ref"), experience.dispatch("ref")
    assert (len(first), len(second)) == (4, 4)
    assert set(first.rows).isdisjoint(second.rows)
    assert len(experience.dispatch("reward", groups=True)) == 8


def test_groups_hands_out_whole_groups_only_once_all_are_ready(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=4)
    experience.register("advantage", needs=["reward"], produces=["adv"])
    experience.put(0, [(0, k) for k in range(4)] + [(2, k) for k in range(4)], {"reward": [0.0] * 8})
    experience.put(0, [(1, 0), (1, 1), (1, 3)], {"reward": [1.0] * 3})
    batch = experience.dispatch("advantage", 12, groups=True)
    assert batch.rows == (*[(0, k) for k in range(4)], *[(2, k) for k in range(4)])
    assert experience.dispatch("advantage", 4, groups=True).lease is None
    # Slot 1's three written rows are ready row by row; only groups holds them back.
    assert counts(experience, "advantage", 0) == (12, 0, 8, 3)
    experience.put(0, [(1, 2)], {"reward": [1.0]})
    last = experience.dispatch("advantage", 4, groups=True)
    assert last.rows == tuple((1, k) for k in range(4))
    assert [len(b) for b in (batch, last)] == [8, 4]


def test_groups_takes_at_most_count_rows_of_whole_groups(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=2)
    experience.register("advantage", needs=["reward"])
    experience.put(0, all_rows(3, 2), {"reward": [0.0] * 6})
    assert experience.dispatch("advantage", 4, groups=True).rows == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert experience.dispatch("advantage", 4, groups=True).rows == ((2, 0), (2, 1))


def test_groups_with_a_count_off_the_group_size_is_refused(experience: ExperienceStore) -> None:
    experience.open(0, slots=3, group_size=4)
    experience.register("advantage", needs=["reward"])
    experience.put(0, all_rows(3, 4), {"reward": [0.0] * 12})
    with pytest.raises(
        ExperienceInputError, match=re.escape("count: 6 is not a multiple of iteration 0's group_size 4")
    ):
        experience.dispatch("advantage", 6, groups=True)
    assert counts(experience, "advantage", 0) == (12, 0, 0, 12)


@pytest.mark.parametrize(("n", "dp_size"), [(10, 3), (8, 2), (5, 5), (3, 4), (7, 1)])
def test_dp_size_splits_the_rows_into_near_equal_parts(experience: ExperienceStore, n: int, dp_size: int) -> None:
    experience.open(0, slots=n, group_size=1)
    experience.register("actor", needs=["prompt"])
    experience.put(0, all_rows(n, 1), {"prompt": [str(i) for i in range(n)]})
    batch = experience.dispatch("actor", n, dp_size=dp_size)
    assert len(batch.parts) == dp_size
    assert covered_once(batch.parts, n)
    sizes = [len(p) for p in batch.parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("slots", "group_size", "dp_size"), [(4, 3, 2), (4, 3, 3), (5, 2, 2), (2, 4, 2), (3, 2, 4)])
def test_dp_size_with_groups_keeps_each_group_in_one_part(
    experience: ExperienceStore, slots: int, group_size: int, dp_size: int
) -> None:
    experience.open(0, slots=slots, group_size=group_size)
    experience.register("actor", needs=["prompt"])
    experience.put(0, all_rows(slots, group_size), {"prompt": ["p"] * (slots * group_size)})
    batch = experience.dispatch("actor", slots * group_size, groups=True, dp_size=dp_size)
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
def test_balance_by_splits_by_tokens(experience: ExperienceStore, lengths: list[int]) -> None:
    n = len(lengths)
    experience.open(0, slots=n, group_size=1)
    experience.register("actor", needs=["prompt", "ids"])
    experience.put(0, all_rows(n, 1), {"prompt": ["p"] * n, "ids": [np.full(m, 7, dtype=np.int32) for m in lengths]})
    batch = experience.dispatch("actor", n, dp_size=2, balance_by="ids")
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


def test_balance_by_an_integer_column_and_under_a_token_cap(experience: ExperienceStore) -> None:
    lengths = [9, 3, 6, 2, 8, 4]
    experience.open(0, slots=6, group_size=1)
    experience.register("actor", needs=["length"])
    experience.put(0, all_rows(6, 1), {"length": lengths})
    batch = experience.dispatch("actor", 6, dp_size=2, balance_by="length", max_tokens_per_microbatch=10)
    assert covered_once(batch.parts, 6)
    assert batch.columns["length"] == lengths


def test_balance_by_a_text_column_is_refused_and_claims_nothing(experience: ExperienceStore) -> None:
    ready_table(experience, slots=2, group_size=1)
    with pytest.raises(ExperienceInputError, match=re.escape("balance_by: row 0 has 'p0.0' there")):
        experience.dispatch("scorer", 2, dp_size=2, balance_by="prompt")
    assert counts(experience, "scorer", 0) == (2, 0, 0, 2)


# --- collect and consumption ----------------------------------------------------------------------------------


def test_collect_marks_rows_consumed_and_consumption_follows_each_step(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=2)
    experience.register("scorer", needs=["prompt"], produces=["score"])
    assert counts(experience, "scorer", 0) == (4, 0, 0, 0)
    experience.put(0, all_rows(2, 2), {"prompt": ["a", "b", "c", "d"]})
    assert counts(experience, "scorer", 0) == (4, 0, 0, 4)
    batch = experience.dispatch("scorer", 3)
    assert batch.lease is not None
    assert counts(experience, "scorer", 0) == (4, 0, 3, 1)
    assert experience.collect(batch.lease, {"score": [0.0, 0.5, 1.0]}) == Collected("scorer", 0, batch.rows)
    assert counts(experience, "scorer", 0) == (4, 3, 0, 1)
    assert experience.read(0, list(batch.rows), ["score"]) == {"score": [0.0, 0.5, 1.0]}
    assert dict(experience.table(0).written) == {"prompt": 4, "score": 3}
    assert not experience.all_consumed("scorer", 0)
    last = experience.dispatch("scorer", 3)
    assert last.lease is not None and len(last) == 1
    assert counts(experience, "scorer", 0) == (4, 3, 1, 0)
    experience.collect(last.lease, {"score": [2.0]})
    status = experience.consumption("scorer", 0)
    assert status == Consumption("scorer", 0, 4, 4, 0, 0)
    assert status.all_consumed and experience.all_consumed("scorer", 0)
    assert experience.dispatch("scorer", 3).lease is None


def test_a_row_whose_result_a_writer_wrote_is_not_handed_out_and_counts_as_consumed(
    experience: ExperienceStore,
) -> None:
    ready_table(experience, slots=2, group_size=2)
    experience.put(0, [(0, 1)], {"score": [7.0]})
    assert counts(experience, "scorer", 0) == (4, 1, 0, 3)
    batch = experience.dispatch("scorer", 100)
    assert batch.lease is not None and batch.rows == ((0, 0), (1, 0), (1, 1))
    experience.collect(batch.lease, {"score": [1.0, 2.0, 3.0]})
    assert experience.consumption("scorer", 0) == Consumption("scorer", 0, 4, 4, 0, 0)
    assert experience.all_consumed("scorer", 0)
    assert experience.read(0, [(0, 1)], ["score"]) == {"score": [7.0]}


def test_a_row_whose_result_is_written_while_it_is_leased_is_not_handed_out_again(
    experience: ExperienceStore,
) -> None:
    ready_table(experience, slots=1, group_size=2)
    held = experience.dispatch("scorer", 2, lease_s=SHORT_LEASE_S)
    assert held.lease is not None
    experience.put(0, [(0, 0)], {"score": [7.0]})
    assert counts(experience, "scorer", 0) == (2, 0, 2, 0)
    with pytest.raises(CellConflictError, match="score"):
        experience.collect(held.lease, {"score": [1.0, 2.0]})
    time.sleep(PAST_SHORT_LEASE_S)
    assert counts(experience, "scorer", 0) == (2, 1, 0, 1)
    again = experience.dispatch("scorer", 2)
    assert again.lease is not None and again.rows == ((0, 1),)
    experience.collect(again.lease, {"score": [2.0]})
    assert experience.all_consumed("scorer", 0)
    assert experience.read(0, [(0, 0), (0, 1)], ["score"]) == {"score": [7.0, 2.0]}


def test_a_consumer_that_produces_nothing_collects_an_empty_mapping(experience: ExperienceStore) -> None:
    experience.open(0, slots=2, group_size=1)
    experience.register("logger", needs=["prompt"])
    experience.put(0, all_rows(2, 1), {"prompt": ["a", "b"]})
    batch = experience.dispatch("logger", 2)
    assert batch.lease is not None
    experience.collect(batch.lease, {})
    assert experience.all_consumed("logger", 0)
    assert dict(experience.table(0).written) == {"prompt": 2}


def test_collect_again_with_the_same_values_is_a_no_op_and_with_others_a_conflict(experience: ExperienceStore) -> None:
    ready_table(experience, slots=2, group_size=1)
    batch = experience.dispatch("scorer", 2)
    assert batch.lease is not None
    experience.collect(batch.lease, {"score": [0.25, 0.75]})
    experience.collect(batch.lease, {"score": [0.25, 0.75]})
    assert counts(experience, "scorer", 0) == (2, 2, 0, 0)
    with pytest.raises(CellConflictError, match="column 'score' of row"):
        experience.collect(batch.lease, {"score": [0.25, 0.5]})
    assert experience.read(0, list(batch.rows), ["score"]) == {"score": [0.25, 0.75]}
    assert counts(experience, "scorer", 0) == (2, 2, 0, 0)


def test_collect_of_a_column_the_consumer_does_not_produce_is_refused(experience: ExperienceStore) -> None:
    ready_table(experience, slots=2, group_size=1)
    batch = experience.dispatch("scorer", 2)
    assert batch.lease is not None
    with pytest.raises(
        ExperienceInputError,
        match=re.escape("columns: consumer 'scorer' does not produce ['advantage']; it produces ['score']"),
    ):
        experience.collect(batch.lease, {"score": [1.0, 1.0], "advantage": [0.0, 0.0]})
    assert counts(experience, "scorer", 0) == (2, 0, 2, 0)
    assert "score" not in experience.table(0).written
    experience.collect(batch.lease, {"score": [1.0, 1.0]})
    assert experience.all_consumed("scorer", 0)


def test_collect_with_the_wrong_number_of_values_is_refused_and_the_lease_stays(experience: ExperienceStore) -> None:
    ready_table(experience, slots=3, group_size=1)
    batch = experience.dispatch("scorer", 3)
    assert batch.lease is not None
    with pytest.raises(ExperienceInputError, match=re.escape("columns.score: 2 values for 3 rows")):
        experience.collect(batch.lease, {"score": [1.0, 2.0]})
    assert counts(experience, "scorer", 0) == (3, 0, 3, 0)
    experience.collect(batch.lease, {"score": [1.0, 2.0, 3.0]})
    assert counts(experience, "scorer", 0) == (3, 3, 0, 0)


def test_collect_of_an_unknown_lease_is_a_lease_error(experience: ExperienceStore) -> None:
    ready_table(experience, slots=1, group_size=1)
    with pytest.raises(LeaseError, match="is unknown"):
        experience.collect("0123456789abcdef0123456789abcdef", {"score": [1.0]})


def test_collect_and_dispatch_stores_the_results_and_hands_out_the_next_rows(experience: ExperienceStore) -> None:
    ready_table(experience, slots=5, group_size=1)
    first = experience.dispatch("scorer", 2)
    assert first.lease is not None
    collected, second = experience.collect_and_dispatch(first.lease, {"score": [0.0, 1.0]}, 2)
    assert collected == Collected("scorer", 0, first.rows)
    assert second.lease is not None and second.consumer == "scorer"
    assert len(second) == 2 and not set(second.rows) & set(first.rows)
    assert second.columns["prompt"] == [f"p{s}.{k}" for s, k in second.rows]
    assert counts(experience, "scorer", 0) == (5, 2, 2, 1)
    _, third = experience.collect_and_dispatch(second.lease, {"score": [2.0, 3.0]}, 2)
    assert third.lease is not None and len(third) == 1
    _, none = experience.collect_and_dispatch(third.lease, {"score": [4.0]}, 2)
    assert none.lease is None and len(none) == 0
    assert experience.all_consumed("scorer", 0)
    rows = [*first.rows, *second.rows, *third.rows]
    assert experience.read(0, rows, ["score"]) == {"score": [0.0, 1.0, 2.0, 3.0, 4.0]}


def test_a_refused_collection_dispatches_nothing(experience: ExperienceStore) -> None:
    ready_table(experience, slots=3, group_size=1)
    batch = experience.dispatch("scorer", 1)
    assert batch.lease is not None
    with pytest.raises(ExperienceInputError, match=re.escape("columns.score: 2 values for 1 rows")):
        experience.collect_and_dispatch(batch.lease, {"score": [1.0, 2.0]}, 2)
    assert counts(experience, "scorer", 0) == (3, 0, 1, 2)
    with pytest.raises(LeaseError, match="is unknown"):
        experience.collect_and_dispatch("0123456789abcdef0123456789abcdef", {"score": [1.0]}, 2)
    assert counts(experience, "scorer", 0) == (3, 0, 1, 2)


def test_a_refused_dispatch_after_a_collection_keeps_the_collection(experience: ExperienceStore) -> None:
    ready_table(experience, slots=3, group_size=1)
    batch = experience.dispatch("scorer", 1)
    assert batch.lease is not None
    # scorer has no dispatch_size, so a dispatch without count is refused: after the collection is stored.
    with pytest.raises(ExperienceInputError, match="has no dispatch_size; give count"):
        experience.collect_and_dispatch(batch.lease, {"score": [1.0]})
    assert counts(experience, "scorer", 0) == (3, 1, 0, 2)
    assert experience.read(0, batch.rows, ["score"]) == {"score": [1.0]}
    collected, nxt = experience.collect_and_dispatch(batch.lease, {"score": [1.0]}, 2)  # a retry: a no-op
    assert collected.rows == batch.rows and len(nxt) == 2
    assert counts(experience, "scorer", 0) == (3, 1, 2, 0)


def ready_tables(experience: ExperienceStore, tables: int, slots: int = 2) -> None:
    for iteration in range(tables):
        ready_table(experience, slots=slots, group_size=1, iteration=iteration)


def test_dispatch_many_takes_rows_of_the_oldest_tables_a_lease_each(experience: ExperienceStore) -> None:
    ready_tables(experience, 4)
    found = experience.dispatch_many("scorer", 5, tables=3)
    assert [(d.iteration, len(d)) for d in found] == [(0, 2), (1, 2), (2, 1)]
    assert len({d.lease for d in found}) == 3 and None not in {d.lease for d in found}
    assert [d.columns["prompt"] for d in found] == [["p0.0", "p1.0"], ["p0.0", "p1.0"], ["p0.0"]]
    assert [counts(experience, "scorer", i) for i in range(4)] == [
        (2, 0, 2, 0),
        (2, 0, 2, 0),
        (2, 0, 1, 1),
        (2, 0, 0, 2),
    ]
    # At most `tables` tables, whatever is left of count.
    assert [(d.iteration, len(d)) for d in experience.dispatch_many("scorer", 8, tables=1)] == [(2, 1)]
    assert [(d.iteration, len(d)) for d in experience.dispatch_many("scorer", 8)] == [(3, 2)]
    assert experience.dispatch_many("scorer", 8) == ()


def test_collect_many_collects_each_lease_and_answers_a_refused_one_in_its_place(experience: ExperienceStore) -> None:
    ready_tables(experience, 3)
    late = experience.dispatch("scorer", 2, iteration=0, lease_s=SHORT_LEASE_S)
    assert late.lease is not None
    time.sleep(PAST_SHORT_LEASE_S)
    held = experience.dispatch_many("scorer", 4, tables=2)
    assert [d.iteration for d in held] == [0, 1]  # the expired lease's rows went back to the pool
    unknown = "0123456789abcdef0123456789abcdef"
    results = [
        (late.lease, {"score": [9.0, 9.0]}),
        *((d.lease or "", {"score": [float(iteration), 1.0]}) for iteration, d in enumerate(held)),
        (unknown, {"score": [1.0]}),
    ]
    outcomes = experience.collect_many("scorer", results)
    assert isinstance(outcomes[0], LeaseError) and "expired" in str(outcomes[0])
    assert outcomes[1:3] == (Collected("scorer", 0, held[0].rows), Collected("scorer", 1, held[1].rows))
    assert isinstance(outcomes[3], LeaseError) and "is unknown" in str(outcomes[3])
    assert experience.read(0, [(0, 0), (1, 0)], ["score"]) == {"score": [0.0, 1.0]}
    assert experience.read(1, [(0, 0), (1, 0)], ["score"]) == {"score": [1.0, 1.0]}
    assert experience.all_consumed("scorer", 0) and experience.all_consumed("scorer", 1)
    assert experience.collect_many("scorer", results[1:3]) == outcomes[1:3]  # a retry: a no-op


def test_collect_many_refused_for_one_collections_input_writes_none_of_them(experience: ExperienceStore) -> None:
    ready_tables(experience, 2)
    held = experience.dispatch_many("scorer", 4)
    assert [d.iteration for d in held] == [0, 1]
    results = [(held[0].lease or "", {"score": [1.0, 2.0]}), (held[1].lease or "", {"score": [1.0]})]
    with pytest.raises(ExperienceInputError, match=re.escape("columns.score: 1 values for 2 rows")):
        experience.collect_many("scorer", results)
    assert [counts(experience, "scorer", i) for i in range(2)] == [(2, 0, 2, 0), (2, 0, 2, 0)]
    assert "score" not in experience.table(0).written
    experience.register("other", needs=["prompt"], produces=["score"])
    with pytest.raises(
        ExperienceInputError, match=r"^collections\[0\]: lease .* belongs to consumer 'scorer', not 'other'"
    ):
        experience.collect_many("other", results[:1])
    assert counts(experience, "scorer", 0) == (2, 0, 2, 0)


def test_collect_and_dispatch_many_stores_the_results_and_hands_out_the_next_tables(
    experience: ExperienceStore,
) -> None:
    ready_tables(experience, 3)
    first = experience.dispatch_many("scorer", 2, tables=2)
    assert [(d.iteration, len(d)) for d in first] == [(0, 2)]
    outcomes, second = experience.collect_and_dispatch_many(
        "scorer", [(first[0].lease or "", {"score": [0.0, 1.0]})], 4, tables=2
    )
    assert outcomes == (Collected("scorer", 0, first[0].rows),)
    assert [(d.iteration, len(d)) for d in second] == [(1, 2), (2, 2)]
    results = [(d.lease or "", {"score": [2.0, 3.0]}) for d in second]
    outcomes, third = experience.collect_and_dispatch_many("scorer", results, 4)
    assert [o.iteration for o in outcomes if isinstance(o, Collected)] == [1, 2] and third == ()
    assert all(experience.all_consumed("scorer", i) for i in range(3))


def test_an_expired_lease_returns_its_rows_and_its_late_collect_is_refused(experience: ExperienceStore) -> None:
    ready_table(experience, slots=2, group_size=2)
    late = experience.dispatch("scorer", 3, lease_s=SHORT_LEASE_S)
    assert late.lease is not None
    time.sleep(PAST_SHORT_LEASE_S)
    assert counts(experience, "scorer", 0) == (4, 0, 0, 4)
    again = experience.dispatch("scorer", 3)
    assert again.lease is not None and again.lease != late.lease
    assert again.rows == late.rows
    with pytest.raises(LeaseError, match="expired") as caught:
        experience.collect(late.lease, {"score": [9.0, 9.0, 9.0]})
    assert "scorer" in str(caught.value)
    with pytest.raises(LeaseError, match="expired"):
        experience.renew(late.lease, 30.0)
    experience.collect(again.lease, {"score": [1.0, 2.0, 3.0]})
    assert experience.read(0, list(again.rows), ["score"]) == {"score": [1.0, 2.0, 3.0]}
    assert counts(experience, "scorer", 0) == (4, 3, 0, 1)


def test_an_expired_lease_is_refused_even_when_nobody_took_its_rows(experience: ExperienceStore) -> None:
    ready_table(experience, slots=1, group_size=2)
    batch = experience.dispatch("scorer", 2, lease_s=SHORT_LEASE_S)
    assert batch.lease is not None
    time.sleep(PAST_SHORT_LEASE_S)
    with pytest.raises(LeaseError, match="expired"):
        experience.collect(batch.lease, {"score": [1.0, 1.0]})
    assert counts(experience, "scorer", 0) == (2, 0, 0, 2)
    assert "score" not in experience.table(0).written


def test_renew_extends_a_lease_past_its_first_expiry(experience: ExperienceStore) -> None:
    ready_table(experience, slots=2, group_size=1)
    batch = experience.dispatch("scorer", 2, lease_s=0.5)
    assert batch.lease is not None and batch.expires_at is not None
    expires_at = experience.renew(batch.lease, 30.0)
    assert expires_at > batch.expires_at
    time.sleep(0.65)
    assert counts(experience, "scorer", 0) == (2, 0, 2, 0)
    assert experience.dispatch("scorer", 2).lease is None
    experience.collect(batch.lease, {"score": [1.0, 0.0]})
    assert experience.all_consumed("scorer", 0)
    with pytest.raises(LeaseError, match="already collected"):
        experience.renew(batch.lease, 30.0)


def test_renew_with_a_bad_lease_s_is_refused(experience: ExperienceStore) -> None:
    ready_table(experience, slots=1, group_size=1)
    batch = experience.dispatch("scorer", 1)
    assert batch.lease is not None
    for lease_s in (0.0, -1.0, 1e9):
        with pytest.raises(ExperienceInputError, match=r"^lease_s: "):
            experience.renew(batch.lease, lease_s)
    with pytest.raises(LeaseError, match="is unknown"):
        experience.renew("0123456789abcdef0123456789abcdef", 30.0)


def test_all_consumed_only_after_every_row_is_collected_and_per_consumer(experience: ExperienceStore) -> None:
    ready_table(experience, slots=3, group_size=1)
    experience.register("critic", needs=["prompt"])
    for _ in range(3):
        assert not experience.all_consumed("scorer", 0)
        batch = experience.dispatch("scorer", 1)
        assert batch.lease is not None
        assert not experience.all_consumed("scorer", 0)
        experience.collect(batch.lease, {"score": [0.0]})
    assert experience.all_consumed("scorer", 0)
    assert not experience.all_consumed("critic", 0)
    assert counts(experience, "critic", 0) == (3, 0, 0, 3)


# --- consume --------------------------------------------------------------------------------------------------


def test_consume_processes_every_row_exactly_once(experience: ExperienceStore) -> None:
    rows = ready_table(experience, slots=4, group_size=2)
    seen: list[RowKey] = []
    sizes: list[int] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        seen.extend(batch.rows)
        sizes.append(len(batch))
        return {"score": [float(len(p)) for p in batch.columns["prompt"]]}

    assert consume(experience, "scorer", 0, work, count=3) == 8
    assert sorted(seen) == rows
    assert sizes == [3, 3, 2]
    assert experience.all_consumed("scorer", 0)
    assert experience.read(0, rows, ["score"]) == {"score": [4.0] * 8}
    assert consume(experience, "scorer", 0, work, count=3) == 0


def test_consume_with_groups_hands_whole_groups(experience: ExperienceStore) -> None:
    ready_table(experience, slots=3, group_size=2)
    batches: list[tuple[RowKey, ...]] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        batches.append(batch.rows)
        return {"score": [1.0] * len(batch)}

    assert consume(experience, "scorer", 0, work, count=4, groups=True) == 6
    assert batches == [((0, 0), (0, 1), (1, 0), (1, 1)), ((2, 0), (2, 1))]


def test_consume_waits_for_rows_written_while_it_runs(experience: ExperienceStore) -> None:
    experience.open(0, slots=4, group_size=1)
    experience.register("scorer", needs=["prompt"], produces=["score"])
    experience.put(0, [(0, 0), (1, 0)], {"prompt": ["a", "b"]})
    seen: list[RowKey] = []

    def work(batch: Dispatch) -> Mapping[str, Sequence[Value]]:
        seen.extend(batch.rows)
        if len(seen) == 2:
            threading.Timer(0.1, lambda: experience.put(0, [(2, 0), (3, 0)], {"prompt": ["c", "d"]})).start()
        return {"score": [1.0] * len(batch)}

    assert consume(experience, "scorer", 0, work, count=2, poll_s=0.02, timeout_s=30.0) == 4
    assert sorted(seen) == all_rows(4, 1)


def test_consume_times_out_when_nothing_becomes_ready(experience: ExperienceStore) -> None:
    experience.open(0, slots=1, group_size=1)
    experience.register("scorer", needs=["prompt"], produces=["score"])
    with pytest.raises(TimeoutError, match="is the producer of its columns running"):
        consume(experience, "scorer", 0, lambda batch: {"score": []}, count=1, poll_s=0.02, timeout_s=0.1)


# --- bad inputs -----------------------------------------------------------------------------------------------

BAD_INPUTS: list[tuple[str, Callable[[ExperienceStore], object], str]] = [
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
    ("tables-0", lambda d: d.dispatch_many("reader", 1, tables=0), "tables: 0 is outside"),
    ("tables-65", lambda d: d.dispatch_many("reader", 1, tables=65), "tables: 65 is outside"),
    ("dispatch_many-count-0", lambda d: d.dispatch_many("reader", 0), "count: 0 is outside"),
    ("dispatch_many-lease_s-0", lambda d: d.dispatch_many("reader", 1, lease_s=0), "lease_s: 0 is outside"),
    (
        "collect_many-too-many",
        lambda d: d.collect_many("reader", [("0123456789abcdef", {})] * 65),
        "collections: 65 is outside",
    ),
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
    experience: ExperienceStore, call: Callable[[ExperienceStore], object], message: str
) -> None:
    experience.open(0, slots=2, group_size=2)
    experience.register("reader", needs=["x"])
    experience.put(0, all_rows(2, 2), {"x": [1, 2, 3, 4]})
    # Over HTTP a value outside the wire schema's bounds is refused by the schema, in its own words: the
    # message still starts with the field.
    expected = message if isinstance(experience, ExperienceStore) else message.split(":")[0]
    with pytest.raises(ExperienceInputError, match="^" + re.escape(expected)):
        call(experience)
    assert [t.iteration for t in experience.tables()] == [0]
    assert dict(experience.table(0).written) == {"x": 4}
    assert [c.name for c in registered(experience)] == ["reader"]
    assert counts(experience, "reader", 0) == (4, 0, 0, 4)
