"""``GenerationLayout``: the arithmetic that maps TRL's sampler indices to generation steps, slots and group members.

The property test replays TRL 1.16's ``RepeatSampler`` (shuffle off) and accelerate's ``BatchSamplerShard``
(global loader batch k goes to process k % P) in plain Python, and checks the layout against that replay.
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from proctor.client.dataset import GenerationLayout

# --- worked examples: one process, two processes, steps_per_generation=4 --------------------------------------


@pytest.mark.parametrize(
    ("b", "p", "s", "g", "prompts", "rows"),
    [
        pytest.param(4, 1, 2, 4, 2, 8, id="B4-P1-S2-G4"),  # one process: 2 unique prompts per optimizer step
        pytest.param(4, 2, 2, 4, 4, 8, id="B4-P2-S2-G4"),  # two ranks: 4 unique prompts
        pytest.param(4, 1, 4, 4, 4, 16, id="B4-P1-S4-G4"),  # one process, steps_per_generation=4
        pytest.param(2, 2, 1, 4, 1, 2, id="B2-P2-S1-G4"),  # one prompt whose group spans both processes
        pytest.param(3, 2, 1, 2, 3, 3, id="B3-P2-S1-G2"),
        pytest.param(8, 4, 1, 8, 4, 8, id="B8-P4-S1-G8"),
    ],
)
def test_prompts_per_generation_and_rows_per_process(b: int, p: int, s: int, g: int, prompts: int, rows: int) -> None:
    layout = GenerationLayout(b, p, s, g)

    assert layout.prompts_per_generation == prompts
    assert layout.rows_per_process == rows


@pytest.mark.parametrize(
    ("layout", "located"),
    [
        pytest.param(
            GenerationLayout(4, 1, 2, 4),
            {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 5: (2, 1), 63: (31, 1)},
            id="B4-P1-S2-G4",
        ),
        pytest.param(
            GenerationLayout(4, 2, 2, 4, process_index=1),
            {0: (0, 0), 3: (0, 3), 4: (1, 0), 7: (1, 3), 9: (2, 1), 63: (15, 3)},
            id="B4-P2-S2-G4",
        ),
        pytest.param(GenerationLayout(2, 2, 1, 4), {0: (0, 0), 1: (1, 0), 3: (3, 0)}, id="B2-P2-S1-G4"),
        pytest.param(GenerationLayout(3, 2, 1, 2), {0: (0, 0), 2: (0, 2), 3: (1, 0), 7: (2, 1)}, id="B3-P2-S1-G2"),
    ],
)
def test_locate(layout: GenerationLayout, located: dict[int, tuple[int, int]]) -> None:
    assert {index: layout.locate(index) for index in located} == located


@pytest.mark.parametrize(
    ("layout", "batch", "members"),
    [
        # One process, shuffle off: the first loader batch is 0×4, 1×4.
        pytest.param(GenerationLayout(4, 1, 2, 4), [0] * 4 + [1] * 4, [0, 1, 2, 3, 0, 1, 2, 3], id="B4-P1-S2-G4-rank0"),
        # Two ranks: rank 0 takes the first half of each 16-row window, rank 1 the second half.
        pytest.param(
            GenerationLayout(4, 2, 2, 4, process_index=0),
            [0] * 4 + [1] * 4,
            [0, 1, 2, 3, 0, 1, 2, 3],
            id="B4-P2-S2-G4-rank0",
        ),
        pytest.param(
            GenerationLayout(4, 2, 2, 4, process_index=1),
            [2] * 4 + [3] * 4,
            [0, 1, 2, 3, 0, 1, 2, 3],
            id="B4-P2-S2-G4-rank1",
        ),
        # The group of prompt 0 is split: rows 0-1 on rank 0, rows 2-3 on rank 1.
        pytest.param(GenerationLayout(2, 2, 1, 4, process_index=0), [0, 0], [0, 1], id="B2-P2-S1-G4-rank0"),
        pytest.param(GenerationLayout(2, 2, 1, 4, process_index=1), [0, 0], [2, 3], id="B2-P2-S1-G4-rank1"),
        # The window 0,0,1,1,2,2 cut in two: prompt 1's pair straddles the processes.
        pytest.param(GenerationLayout(3, 2, 1, 2, process_index=0), [0, 0, 1], [0, 1, 0], id="B3-P2-S1-G2-rank0"),
        pytest.param(GenerationLayout(3, 2, 1, 2, process_index=1), [1, 2, 2], [1, 0, 1], id="B3-P2-S1-G2-rank1"),
    ],
)
def test_completion_index(layout: GenerationLayout, batch: list[int], members: list[int]) -> None:
    assert len(batch) == layout.rows_per_process
    assert [layout.completion_index(position) for position in range(len(batch))] == members


# --- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"per_device_batch_size": 3, "num_processes": 1, "steps_per_generation": 1, "num_generations": 2},
            "the generation batch (3 per device × 1 processes × 1 steps_per_generation = 3) is not a multiple of "
            "num_generations=2; change one of them",
            id="not-a-multiple-of-G",
        ),
        pytest.param(
            {"per_device_batch_size": 2, "num_processes": 3, "steps_per_generation": 2, "num_generations": 8},
            "the generation batch (2 per device × 3 processes × 2 steps_per_generation = 12) is not a multiple of "
            "num_generations=8; change one of them",
            id="not-a-multiple-of-G-multi-process",
        ),
        pytest.param(
            {
                "per_device_batch_size": 4,
                "num_processes": 2,
                "steps_per_generation": 1,
                "num_generations": 4,
                "process_index": 2,
            },
            "process_index 2 is outside 0..1",
            id="process-index-too-high",
        ),
        pytest.param(
            {
                "per_device_batch_size": 4,
                "num_processes": 2,
                "steps_per_generation": 1,
                "num_generations": 4,
                "process_index": -1,
            },
            "process_index -1 is outside 0..1",
            id="process-index-negative",
        ),
    ],
)
def test_validation_messages(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        GenerationLayout(**kwargs)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param((0, 1, 1, 2), id="zero-batch"),
        pytest.param((-4, 1, 1, 4), id="negative-batch"),
        pytest.param((4, 1, 0, 2), id="zero-steps"),
        pytest.param((4, 1, 1, 0), id="zero-generations"),
    ],
)
def test_non_positive_sizes_are_refused(sizes: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match=r"must be positive|at least 1|≥ 1"):
        GenerationLayout(*sizes)


def test_the_layout_is_a_frozen_value() -> None:
    layout = GenerationLayout(4, 2, 2, 4, process_index=1)

    assert layout == GenerationLayout(4, 2, 2, 4, 1)
    assert hash(layout) == hash(GenerationLayout(4, 2, 2, 4, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.process_index = 0  # type: ignore[misc]


# --- from_args ----------------------------------------------------------------------------------------------


def grpo_args(**overrides: int) -> types.SimpleNamespace:
    """The attributes of a ``GRPOConfig`` (after its ``__post_init__``) that the layout reads."""
    values = {
        "per_device_train_batch_size": 4,
        "world_size": 2,
        "steps_per_generation": 2,
        "num_generations": 4,
        "process_index": 1,
    }
    values.update(overrides)
    return types.SimpleNamespace(**values, shuffle_dataset=False, num_iterations=1)


@pytest.mark.parametrize(
    ("args", "overrides", "expected"),
    [
        pytest.param(grpo_args(), {}, GenerationLayout(4, 2, 2, 4, 1), id="from-the-config"),
        pytest.param(grpo_args(), {"process_index": 0}, GenerationLayout(4, 2, 2, 4, 0), id="process-index-0-wins"),
        pytest.param(
            grpo_args(), {"num_processes": 4, "process_index": 3}, GenerationLayout(4, 4, 2, 4, 3), id="both-overridden"
        ),
        pytest.param(
            grpo_args(world_size=1, process_index=0, steps_per_generation=1, num_generations=2),
            {},
            GenerationLayout(4, 1, 1, 2, 0),
            id="single-process",
        ),
    ],
)
def test_from_args(args: types.SimpleNamespace, overrides: dict[str, int], expected: GenerationLayout) -> None:
    layout = GenerationLayout.from_args(args, **overrides)

    assert layout == expected
    assert layout.prompts_per_generation == expected.prompts_per_generation


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(grpo_args(num_generations=3), r"= 16\) is not a multiple of num_generations=3", id="bad-G"),
        pytest.param(grpo_args(process_index=2), r"^process_index 2 is outside 0\.\.1$", id="bad-rank"),
    ],
)
def test_from_args_validates(args: types.SimpleNamespace, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationLayout.from_args(args)


# --- TRL, replayed ------------------------------------------------------------------------------------------


class Config(NamedTuple):
    b: int  # per_device_train_batch_size
    p: int  # processes
    s: int  # steps_per_generation
    g: int  # num_generations
    mu: int  # num_iterations
    steps: int  # generation steps in the dataset
    extra: int  # trailing indices that do not fill a chunk (the sampler drops them)


class Row(NamedTuple):
    """One index the sampler yields, with what the replay knows about it."""

    dataset_index: int  # not `index`, which would hide tuple.index
    chunk: int  # which chunk of the sampler (= generation step)
    slot: int  # position of the index in its chunk
    member: int  # the how-many-th consecutive copy of the index within one repetition of the chunk (0..G-1)
    repetition: int  # which of the chunk's mu·S repetitions


def repeat_sampler(n: int, mini_repeat_count: int, batch_size: int, repeat_count: int) -> Iterator[Row]:
    """TRL 1.16 ``RepeatSampler.__iter__`` with ``shuffle=False`` (trl/trainer/utils.py), annotated."""
    indexes = list(range(n))
    chunks = [indexes[i : i + batch_size] for i in range(0, len(indexes), batch_size)]
    chunks = [chunk for chunk in chunks if len(chunk) == batch_size]
    for number, chunk in enumerate(chunks):
        for repetition in range(repeat_count):
            for slot, index in enumerate(chunk):
                for member in range(mini_repeat_count):
                    yield Row(index, number, slot, member, repetition)


def loader_batches(config: Config) -> list[list[Row]]:
    """The global loader batches of ``GRPOTrainer``: the sampler it builds, cut into batches of B·S."""
    u = config.b * config.p * config.s // config.g  # generation_batch_size // num_generations
    stream = list(
        repeat_sampler(
            n=config.steps * u + config.extra,
            mini_repeat_count=config.g,
            batch_size=u,
            repeat_count=config.mu * config.s,
        )
    )
    size = config.b * config.s
    return [stream[i : i + size] for i in range(0, len(stream), size)]


@st.composite
def configs(draw: st.DrawFn) -> Config:
    b, p, s = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    divisors = [g for g in range(2, 9) if b * p * s % g == 0]
    assume(divisors)
    g = draw(st.sampled_from(divisors))
    u = b * p * s // g
    return Config(b, p, s, g, draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(0, u - 1)))


@settings(max_examples=150, deadline=None)
@given(config=configs())
@example(config=Config(b=2, p=2, s=1, g=4, mu=1, steps=2, extra=0))  # a group split across two processes
@example(config=Config(b=1, p=4, s=1, g=4, mu=2, steps=2, extra=0))  # a group split across four processes
@example(config=Config(b=3, p=2, s=1, g=2, mu=1, steps=3, extra=2))  # a pair straddling the processes
@example(config=Config(b=4, p=1, s=2, g=4, mu=1, steps=3, extra=1))  # the one-process worked example
@example(config=Config(b=4, p=2, s=2, g=4, mu=2, steps=3, extra=3))  # the two-rank one, num_iterations=2
def test_the_layout_matches_what_trl_feeds_each_process(config: Config) -> None:
    b, p, s, g, mu, steps, _ = config
    layouts = [GenerationLayout(b, p, s, g, process_index=r) for r in range(p)]
    u = layouts[0].prompts_per_generation
    assert u == b * p * s // g
    batches = loader_batches(config)
    # Every batch is full and the batches divide evenly among the processes: accelerate never wraps around.
    assert all(len(batch) == layouts[0].rows_per_process for batch in batches)
    assert len(batches) % p == 0
    # BatchSamplerShard: global batch k goes to process k % P; a round is one batch for each process.
    rounds = [batches[k : k + p] for k in range(0, len(batches), p)]
    assert len(rounds) == steps * mu * s

    seen: Counter[tuple[int, int]] = Counter()
    for number, round_ in enumerate(rounds):
        located = [layouts[r].locate(row.dataset_index) for r, batch in enumerate(round_) for row in batch]
        # locate() agrees with the sampler about every index...
        assert located == [(row.chunk, row.slot) for batch in round_ for row in batch]
        # ...and every process is in the same generation step during a round, the step of this round.
        assert {step for step, _ in located} == {number // (mu * s)}
        # One round is one repetition of its chunk: each (slot, member) exactly once over all processes, and
        # completion_index() names the copy the sampler yielded, also when a group spans two processes.
        assert {row.repetition for batch in round_ for row in batch} == {number % (mu * s)}
        pairs = [
            (row.slot, layouts[r].completion_index(position))
            for r, batch in enumerate(round_)
            for position, row in enumerate(batch)
        ]
        assert sorted(pairs) == [(slot, member) for slot in range(u) for member in range(g)]
        assert pairs == [(row.slot, row.member) for batch in round_ for row in batch]
        seen.update(located)

    # Every slot of every step is fetched the same number of times: the sampler's mini_repeat_count ×
    # repeat_count, i.e. G·S·μ, and the indices past the last full chunk never.
    per_slot = g * mu * s
    assert seen == {(step, slot): per_slot for step in range(steps) for slot in range(u)}
    assert sum(seen.values()) == len(batches) * b * s


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Config(b=2, p=2, s=1, g=4, mu=1, steps=2, extra=0), id="B2-P2-S1-G4"),
        pytest.param(Config(b=3, p=2, s=2, g=4, mu=2, steps=2, extra=1), id="B3-P2-S2-G4-mu2"),
        pytest.param(Config(b=4, p=3, s=1, g=6, mu=1, steps=3, extra=0), id="B4-P3-S1-G6"),
    ],
)
def test_the_replayed_sharding_matches_accelerate(config: Config) -> None:
    data_loader = pytest.importorskip("accelerate.data_loader")
    torch_data = pytest.importorskip("torch.utils.data")
    batches = loader_batches(config)
    stream = [row.dataset_index for batch in batches for row in batch]
    # What Trainer builds from DataLoader(batch_size=B·S, sampler=RepeatSampler) and accelerate then shards.
    sampler = torch_data.BatchSampler(stream, batch_size=config.b * config.s, drop_last=False)
    for r in range(config.p):
        shard = data_loader.BatchSamplerShard(sampler, num_processes=config.p, process_index=r, split_batches=False)
        assert list(shard) == [[row.dataset_index for row in batch] for batch in batches[r :: config.p]]
