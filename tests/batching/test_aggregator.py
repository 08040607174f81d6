"""The LCM aggregator: buffer to the service batch, repeat per sample, one compute call, split back, a a b b.

Micro-batches carry global sample ids (micro-batch 0 holds ids 0..b_0−1, micro-batch 1 the next b_1, …), and the
test ``compute`` echoes the ids and numbers its rows, so every output row says which input sample it is.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.batching.aggregator import (
    AggregationConfig,
    Aggregator,
    Array,
    BackgroundProducer,
    Batch,
    EndOfData,
    ServiceCall,
    iter_rounds,
    merge,
    prepare_round,
    repeat_samples,
    sample_count,
    skip_micro_batches,
    split,
)

Kind = Literal["numpy", "torch", "list"]
KINDS: tuple[Kind, ...] = ("numpy", "torch", "list")


def convert(values: list[Any], kind: Kind, dtype: type = int) -> Array:
    if kind == "numpy":
        return np.asarray(values, dtype=np.int64 if dtype is int else np.float32)
    if kind == "torch":
        return torch.tensor(values, dtype=torch.int64 if dtype is int else torch.float32)
    return list(values)


def kind_of(value: Array) -> Kind:
    if isinstance(value, np.ndarray):
        return "numpy"
    if isinstance(value, torch.Tensor):
        return "torch"
    return "list"


def as_list(value: Array) -> list[Any]:
    return value if isinstance(value, list) else value.tolist()


def make_micro_batches(sizes: Sequence[int], kind: Kind = "numpy") -> list[Batch]:
    batches: list[Batch] = []
    start = 0
    for size in sizes:
        ids = list(range(start, start + size))
        batches.append({"id": convert(ids, kind), "score": convert([i / 2 for i in ids], kind, float)})
        start += size
    return batches


def ids_of(sizes: Sequence[int]) -> list[list[int]]:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [list(range(bounds[i], bounds[i + 1])) for i in range(len(sizes))]


def repeated(ids: list[int], times: int) -> list[int]:
    return [i for i in ids for _ in range(times)]


class EchoCompute:
    """Stands in for rollout + advantage: echoes ``id``, numbers the rows, records what it received."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.received: list[Batch] = []
        self.fail_on_call = fail_on_call

    def __call__(self, batch: Batch) -> dict[str, Array]:
        self.received.append(batch)
        if self.fail_on_call == len(self.received):
            raise RuntimeError(f"compute failed on call {len(self.received)}")
        ids = batch["id"]
        return {"id": ids, "row": convert(list(range(len(as_list(ids)))), kind_of(ids))}


class CountingIterator(Iterator[Batch]):
    """Counts how many micro-batches were taken, to check nothing is taken ahead."""

    def __init__(self, batches: Sequence[Batch], fail_at: int | None = None) -> None:
        self._batches = list(batches)
        self.taken = 0
        self.fail_at = fail_at

    def __next__(self) -> Batch:
        if self.taken == self.fail_at:
            raise OSError(f"the data source broke at micro-batch {self.taken}")
        if self.taken >= len(self._batches):
            raise StopIteration
        self.taken += 1
        return self._batches[self.taken - 1]


def expected_rounds(count: int, proceed: int) -> list[list[int]]:
    """Micro-batch indices of each round: everything once for -1, else complete rounds only."""
    if proceed < 0:
        return [list(range(count))]
    return [list(range(start, start + proceed)) for start in range(0, count - proceed + 1, proceed)]


def expected_calls(sizes: Sequence[int], rounds: list[list[int]], target: int, partial: list[int]) -> list[ServiceCall]:
    """The seed's main loop, written as plainly as possible. ``partial`` is the round the data ended in (train
    mode): its full service batches were computed before the end showed, its tail is never computed."""
    calls: list[ServiceCall] = []
    for indices in [*rounds, partial]:
        buffered: list[int] = []
        for index in indices:
            buffered.append(sizes[index])
            if sum(buffered) >= target:
                calls.append(ServiceCall(sum(buffered), len(buffered), forced=False))
                buffered = []
        if buffered and indices is not partial:
            calls.append(ServiceCall(sum(buffered), len(buffered), forced=True))
    return calls


def rounds_as_lists(rounds: list[list[Batch]]) -> list[list[dict[str, list[Any]]]]:
    return [[{key: as_list(value) for key, value in batch.items()} for batch in batches] for batches in rounds]


# --- the worked example of the seed ------------------------------------------------------------------------------


def test_worked_example() -> None:
    # target 4: 2 + 1 = 3 waits, + 3 = 6 computes once for micro-batches 0-2; micro-batch 3 (2 samples) is the
    # forced tail at proceed_num_steps=4.
    compute = EchoCompute()
    aggregator = Aggregator(compute, AggregationConfig(4, sample_repeat=2, batch_repeat=2, proceed_num_steps=4))

    out = aggregator.prepare_round(iter(make_micro_batches([2, 1, 3, 2])))

    assert out is not None
    assert [as_list(batch["id"]) for batch in out] == [
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [2, 2],
        [2, 2],
        [3, 3, 4, 4, 5, 5],
        [3, 3, 4, 4, 5, 5],
        [6, 6, 7, 7],
        [6, 6, 7, 7],
    ]
    assert [as_list(batch["row"]) for batch in out[::2]] == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [0, 1, 2, 3]]
    assert aggregator.calls == [ServiceCall(6, 3, forced=False), ServiceCall(2, 1, forced=True)]
    assert aggregator.compute_calls == 2
    # compute saw each merged batch repeated at sample level: a a b b, never a b a b.
    assert [as_list(batch["id"]) for batch in compute.received] == [
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5],
        [6, 6, 7, 7],
    ]
    assert [as_list(batch["score"]) for batch in compute.received][1] == [3.0, 3.0, 3.5, 3.5]


def test_batch_repeat_emits_the_same_object_and_numpy_pieces_are_views() -> None:
    results: list[Batch] = []

    def compute(batch: Batch) -> Batch:
        results.append({"id": np.asarray(batch["id"]) * 10})
        return results[-1]

    out = prepare_round(iter(make_micro_batches([2, 2])), compute, AggregationConfig(4, batch_repeat=3))

    assert out is not None
    assert len(out) == 6
    assert out[0] is out[1] is out[2]
    assert out[3] is out[4] is out[5]
    assert out[0] is not out[3]
    assert np.shares_memory(out[3]["id"], results[0]["id"])


def test_service_batch_never_spans_rounds() -> None:
    compute = EchoCompute()
    aggregator = Aggregator(compute, AggregationConfig(100, proceed_num_steps=2))

    rounds = list(iter_rounds(iter(make_micro_batches([1, 2, 3, 4])), aggregator))

    assert len(rounds) == 2
    assert aggregator.calls == [ServiceCall(3, 2, forced=True), ServiceCall(7, 2, forced=True)]


def test_eval_takes_everything_once() -> None:
    compute = EchoCompute()
    aggregator = Aggregator(compute, AggregationConfig(3, sample_repeat=2, proceed_num_steps=-1))
    source = iter(make_micro_batches([1, 1, 1, 1, 1]))

    first = aggregator.prepare_round(source)
    second = aggregator.prepare_round(source)

    assert first is not None
    assert [as_list(batch["id"]) for batch in first] == [[i, i] for i in range(5)]
    assert aggregator.calls == [ServiceCall(3, 3, forced=False), ServiceCall(2, 2, forced=True)]
    assert second == []  # nothing left: an empty round, not None, and no compute call
    assert aggregator.compute_calls == 2
    assert list(iter_rounds(iter([]), aggregator)) == [[]]


def test_train_round_takes_exactly_proceed_num_steps() -> None:
    source = CountingIterator(make_micro_batches([1] * 7))
    aggregator = Aggregator(EchoCompute(), AggregationConfig(2, proceed_num_steps=3))

    out = aggregator.prepare_round(source)

    assert out is not None
    assert len(out) == 3
    assert source.taken == 3


def test_train_mode_drops_a_partial_round_at_the_end_of_the_data() -> None:
    source = CountingIterator(make_micro_batches([4, 4, 4, 4, 4]))
    aggregator = Aggregator(EchoCompute(), AggregationConfig(4, proceed_num_steps=2))

    rounds = [aggregator.prepare_round(source) for _ in range(4)]

    assert [None if r is None else len(r) for r in rounds] == [2, 2, None, None]
    assert source.taken == 5
    assert aggregator.dropped == 1
    # The dropped micro-batch filled a service batch by itself, so it was computed before the data ended.
    assert aggregator.compute_calls == 5


def test_train_mode_exactly_exhausted_drops_nothing() -> None:
    aggregator = Aggregator(EchoCompute(), AggregationConfig(4, proceed_num_steps=2))

    rounds = list(iter_rounds(iter(make_micro_batches([1, 2, 3, 4])), aggregator))

    assert len(rounds) == 2
    assert aggregator.dropped == 0


# --- kinds of arrays ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_kinds_and_dtypes_are_kept(kind: Kind) -> None:
    out = prepare_round(
        iter(make_micro_batches([2, 3], kind)), EchoCompute(), AggregationConfig(5, sample_repeat=2, batch_repeat=1)
    )

    assert out is not None
    assert [kind_of(batch["id"]) for batch in out] == [kind, kind]
    assert [as_list(batch["id"]) for batch in out] == [[0, 0, 1, 1], [2, 2, 3, 3, 4, 4]]
    if kind == "numpy":
        assert out[0]["id"].dtype == np.int64  # type: ignore[union-attr]
    if kind == "torch":
        assert out[0]["id"].dtype == torch.int64  # type: ignore[union-attr]


def test_trailing_dimensions_survive() -> None:
    tokens = [np.arange(6).reshape(2, 3), np.arange(6, 9).reshape(1, 3)]
    merged = merge([{"tokens": tokens[0]}, {"tokens": tokens[1]}])
    twice = repeat_samples(merged, 2)

    assert twice["tokens"].shape == (6, 3)  # type: ignore[union-attr]
    assert as_list(twice["tokens"])[:2] == [[0, 1, 2], [0, 1, 2]]
    pieces = split(twice, [4, 2])
    assert [as_list(piece["tokens"]) for piece in pieces][1] == [[6, 7, 8], [6, 7, 8]]

    tensor = repeat_samples({"t": torch.arange(4).reshape(2, 2)}, 3)["t"]
    assert as_list(tensor) == [[0, 1]] * 3 + [[2, 3]] * 3


def test_mixed_keys_of_different_kinds_in_one_micro_batch() -> None:
    micro_batches: list[Batch] = [
        {"prompt": ["p0", "p1"], "ids": np.array([0, 1]), "mask": torch.tensor([1, 0])},
        {"prompt": ["p2"], "ids": np.array([2]), "mask": torch.tensor([1])},
    ]

    out = prepare_round(iter(micro_batches), lambda batch: batch, AggregationConfig(3, sample_repeat=2))

    assert out is not None
    assert out[1] == {"prompt": ["p2", "p2"], "ids": out[1]["ids"], "mask": out[1]["mask"]}
    assert as_list(out[0]["ids"]) == [0, 0, 1, 1]
    assert as_list(out[0]["mask"]) == [1, 1, 0, 0]


# --- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param(
            {"service_target_bs": 0},
            ValueError,
            "service_target_bs must be a positive integer, got 0",
            id="zero-target",
        ),
        pytest.param(
            {"service_target_bs": 4, "sample_repeat": 0},
            ValueError,
            "sample_repeat must be a positive integer, got 0",
            id="zero-sample-repeat",
        ),
        pytest.param(
            {"service_target_bs": 4, "batch_repeat": -1},
            ValueError,
            "batch_repeat must be a positive integer, got -1",
            id="negative-batch-repeat",
        ),
        pytest.param(
            {"service_target_bs": 4, "proceed_num_steps": 0},
            ValueError,
            "proceed_num_steps must be a positive integer, or -1 to take everything once, got 0",
            id="zero-steps",
        ),
        pytest.param(
            {"service_target_bs": 4, "proceed_num_steps": -2},
            ValueError,
            "proceed_num_steps must be a positive integer, or -1 to take everything once, got -2",
            id="minus-two-steps",
        ),
        pytest.param(
            {"service_target_bs": 4.0}, TypeError, "service_target_bs must be an int, got 4.0", id="float-target"
        ),
        pytest.param(
            {"service_target_bs": True}, TypeError, "service_target_bs must be an int, got True", id="bool-target"
        ),
    ],
)
def test_config_validation(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        AggregationConfig(**kwargs)
    assert str(caught.value) == message


def test_config_from_micro_sizes() -> None:
    config = AggregationConfig.from_micro_sizes(4, 6, 8, sample_repeat=4, batch_repeat=2, proceed_num_steps=3)

    assert config == AggregationConfig(24, 4, 2, 3)
    with pytest.raises(ValueError, match="micro-batch size #1 must be a positive integer, got 0"):
        AggregationConfig.from_micro_sizes(4, 0)


@pytest.mark.parametrize(
    ("micro_batches", "error", "message"),
    [
        pytest.param(
            [{"id": np.array([0])}, {"id": [1]}],
            TypeError,
            "key 'id' is a numpy value in micro-batch 0 but a list value in micro-batch 1; one key must keep one kind",
            id="kinds-differ",
        ),
        pytest.param(
            [{"id": np.array([0])}, {"id": np.array([1]), "extra": np.array([1])}],
            ValueError,
            "micro-batch 1 has keys ['extra', 'id'] but micro-batch 0 has ['id']; all micro-batches must have the same keys",
            id="keys-differ",
        ),
        pytest.param(
            [{"id": np.array([0, 1]), "score": np.array([0.0])}],
            ValueError,
            "micro-batch 0 of the round has arrays of different leading lengths ('id': 2, 'score': 1)",
            id="ragged",
        ),
        pytest.param(
            [{"id": (0, 1)}],
            TypeError,
            "micro-batch 0 of the round['id'] is a tuple; expected a numpy array, a torch tensor or a list",
            id="tuple",
        ),
        pytest.param(
            [{"id": np.array(3)}],
            ValueError,
            "micro-batch 0 of the round['id'] is 0-dimensional; it needs a leading batch axis",
            id="scalar",
        ),
        pytest.param([{}], ValueError, "micro-batch 0 of the round has no arrays", id="empty"),
    ],
)
def test_bad_micro_batches(micro_batches: list[Batch], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        prepare_round(iter(micro_batches), EchoCompute(), AggregationConfig(2))
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("result", "message"),
    [
        pytest.param(
            {"adv": np.zeros(3)},
            "compute's result['adv'] has 3 rows; expected 4 (2 merged samples × sample_repeat 2)",
            id="short",
        ),
        pytest.param({}, "compute returned no arrays", id="empty"),
    ],
)
def test_bad_compute_results(result: Batch, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        prepare_round(iter(make_micro_batches([2])), lambda batch: result, AggregationConfig(2, sample_repeat=2))
    assert str(caught.value) == message


def test_helpers() -> None:
    assert sample_count({"a": [1, 2], "b": np.zeros((2, 5))}) == 2
    with pytest.raises(ValueError, match=r"cannot split 3 rows into pieces of \[1, 1\] \(sum 2\)"):
        split({"a": [1, 2, 3]}, [1, 1])
    with pytest.raises(ValueError, match="merge needs at least one micro-batch"):
        merge([])
    source = iter(range(5))
    assert skip_micro_batches(source, 3) == 3
    assert list(source) == [3, 4]
    assert skip_micro_batches(iter(range(2)), 10) == 2
    with pytest.raises(ValueError, match="skip must be an int of zero or more, got -1"):
        skip_micro_batches(iter(range(2)), -1)


# --- properties --------------------------------------------------------------------------------------------------

sizes_strategy = st.lists(st.integers(1, 5), min_size=0, max_size=8)


@settings(max_examples=80, deadline=None)
@given(
    sizes=sizes_strategy,
    target=st.integers(1, 12),
    sample_repeat=st.integers(1, 3),
    batch_repeat=st.integers(1, 3),
    proceed=st.sampled_from([-1, 1, 2, 3, 4]),
    kind=st.sampled_from(KINDS),
)
def test_rounds_place_every_sample_in_order(
    sizes: list[int], target: int, sample_repeat: int, batch_repeat: int, proceed: int, kind: Kind
) -> None:
    compute = EchoCompute()
    aggregator = Aggregator(compute, AggregationConfig(target, sample_repeat, batch_repeat, proceed))

    rounds = list(iter_rounds(iter(make_micro_batches(sizes, kind)), aggregator))

    wanted = expected_rounds(len(sizes), proceed)
    ids = ids_of(sizes)
    assert len(rounds) == len(wanted)
    for batches, indices in zip(rounds, wanted, strict=True):
        # Output μ·i + m is micro-batch i, each sample r times in a row: boundaries, a a b b and "every sample
        # exactly once per batch_repeat" in one comparison.
        assert [as_list(batch["id"]) for batch in batches] == [
            repeated(ids[index], sample_repeat) for index in indices for _ in range(batch_repeat)
        ]
        assert all(kind_of(batch["id"]) == kind for batch in batches)
    # One compute call per service batch: ≥ target samples, except a round's forced tail.
    partial = list(range(len(wanted) * proceed, len(sizes))) if proceed > 0 else []
    calls = expected_calls(sizes, wanted, target, partial)
    assert aggregator.calls == calls
    assert all(call.samples >= target for call in aggregator.calls if not call.forced)
    assert all(call.samples < target for call in aggregator.calls if call.forced)
    # compute saw each merged batch repeated at sample level, in input order, no sample twice across calls.
    seen = [i for batch in compute.received for i in as_list(batch["id"])]
    computed = sum(call.samples for call in calls)
    assert seen == repeated(list(range(computed)), sample_repeat)
    assert aggregator.dropped == len(partial)


@settings(max_examples=25, deadline=None)
@given(
    sizes=sizes_strategy, target=st.integers(1, 8), sample_repeat=st.integers(1, 3), proceed=st.sampled_from([-1, 2, 3])
)
def test_numpy_torch_and_lists_give_the_same_rounds(
    sizes: list[int], target: int, sample_repeat: int, proceed: int
) -> None:
    results = {}
    for kind in KINDS:
        aggregator = Aggregator(EchoCompute(), AggregationConfig(target, sample_repeat, 2, proceed))
        rounds = list(iter_rounds(iter(make_micro_batches(sizes, kind)), aggregator))
        results[kind] = (rounds_as_lists(rounds), aggregator.calls)

    assert results["numpy"] == results["torch"] == results["list"]


# --- the background producer -------------------------------------------------------------------------------------


def drain(producer: BackgroundProducer) -> list[Any]:
    items: list[Any] = []
    while not isinstance(item := producer.queue.get(timeout=5), EndOfData):
        items.append(item)
    items.append(item)
    return items


@settings(max_examples=15, deadline=None)
@given(
    sizes=sizes_strategy,
    target=st.integers(1, 8),
    batch_repeat=st.integers(1, 2),
    proceed=st.sampled_from([-1, 1, 2, 3]),
    maxsize=st.integers(1, 4),
)
def test_background_producer_matches_the_synchronous_path(
    sizes: list[int], target: int, batch_repeat: int, proceed: int, maxsize: int
) -> None:
    config = AggregationConfig(target, 2, batch_repeat, proceed)
    synchronous = Aggregator(EchoCompute(), config)
    expected = list(iter_rounds(iter(make_micro_batches(sizes)), synchronous))

    background = Aggregator(EchoCompute(), config)
    with BackgroundProducer(iter(make_micro_batches(sizes)), background, maxsize=maxsize) as producer:
        got = list(producer)

    assert rounds_as_lists(got) == rounds_as_lists(expected)
    assert background.calls == synchronous.calls


@pytest.mark.timeout(20)
def test_queue_protocol_rounds_end_with_none_then_end_of_data() -> None:
    aggregator = Aggregator(EchoCompute(), AggregationConfig(3, batch_repeat=2, proceed_num_steps=2))
    producer = BackgroundProducer(iter(make_micro_batches([1, 1, 1, 1, 1, 1, 1])), aggregator, maxsize=2)

    items = drain(producer)
    producer.close()

    shape = ["batch" if isinstance(item, dict) else item for item in items]
    assert shape == (["batch"] * 4 + [None]) * 3 + [EndOfData()]
    assert not producer.running


@pytest.mark.timeout(20)
def test_eval_producer_yields_one_round() -> None:
    aggregator = Aggregator(EchoCompute(), AggregationConfig(2, proceed_num_steps=-1))
    with BackgroundProducer(iter(make_micro_batches([1, 2, 3])), aggregator) as producer:
        rounds = list(producer)
        again = list(producer)

    assert [[as_list(batch["id"]) for batch in batches] for batches in rounds] == [[[0], [1, 2], [3, 4, 5]]]
    assert again == []


@pytest.mark.timeout(20)
def test_compute_exception_surfaces_in_the_consumer() -> None:
    aggregator = Aggregator(EchoCompute(fail_on_call=2), AggregationConfig(2, proceed_num_steps=1))
    rounds: list[list[Batch]] = []

    with BackgroundProducer(iter(make_micro_batches([2, 2, 2])), aggregator) as producer:
        with pytest.raises(RuntimeError, match="compute failed on call 2"):
            for batches in producer:
                rounds.append(batches)
        # Iterating again re-raises instead of hanging.
        with pytest.raises(RuntimeError, match="compute failed on call 2"):
            list(producer)

    assert [[as_list(batch["id"]) for batch in batches] for batches in rounds] == [[[0, 1]]]


@pytest.mark.timeout(20)
def test_iterator_exception_ends_the_queue_with_the_error() -> None:
    aggregator = Aggregator(EchoCompute(), AggregationConfig(2, proceed_num_steps=1))
    producer = BackgroundProducer(CountingIterator(make_micro_batches([2, 2, 2]), fail_at=1), aggregator)

    items = drain(producer)
    producer.close()

    assert [type(item).__name__ for item in items] == ["dict", "NoneType", "EndOfData"]
    assert isinstance(items[-1].error, OSError)
    assert str(items[-1].error) == "the data source broke at micro-batch 1"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("skip", [0, 1, 2, 3, 5, 6, 50])
def test_skip_resumes_exactly_after_the_skipped_micro_batches(skip: int) -> None:
    sizes = [1, 2, 1, 3, 1, 2]
    config = AggregationConfig(2, sample_repeat=2, batch_repeat=2, proceed_num_steps=2)
    resumed = itertools.islice(iter(make_micro_batches(sizes)), skip, None)
    expected = list(iter_rounds(resumed, Aggregator(EchoCompute(), config)))

    with BackgroundProducer(iter(make_micro_batches(sizes)), Aggregator(EchoCompute(), config), skip=skip) as producer:
        got = list(producer)

    assert rounds_as_lists(got) == rounds_as_lists(expected)
    # And by ids: the first round starts at the first micro-batch after the skipped ones.
    if skip == 3:
        assert [as_list(batch["id"]) for batch in got[0]] == [[4, 4, 5, 5, 6, 6]] * 2 + [[7, 7]] * 2
    if skip >= len(sizes) - 1:
        assert got == []


def test_producer_validates_its_arguments() -> None:
    aggregator = Aggregator(EchoCompute(), AggregationConfig(2))
    with pytest.raises(ValueError, match="skip must be an int of zero or more, got -3"):
        BackgroundProducer(iter([]), aggregator, skip=-3)
    with pytest.raises(ValueError, match="maxsize must be a positive integer, got 0"):
        BackgroundProducer(iter([]), aggregator, maxsize=0)


@pytest.mark.timeout(20)
def test_bounded_queue_holds_the_producer_back_and_close_stops_it() -> None:
    source = CountingIterator(make_micro_batches([1] * 50))
    aggregator = Aggregator(EchoCompute(), AggregationConfig(1, proceed_num_steps=1))
    # One round is one batch and its None: the queue holds one round, the producer prepares one more and waits.
    producer = BackgroundProducer(source, aggregator, maxsize=2)
    deadline = time.monotonic() + 5
    while not producer.queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)

    assert producer.queue.full()
    assert source.taken == 2

    producer.close(timeout=5)
    assert not producer.running
    assert list(producer) == []  # closed: the consumer ends instead of waiting for rounds that will not come
