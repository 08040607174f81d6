"""Tests for batch composition in :mod:`proctor.server.curriculum.mixing`."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proctor.server.curriculum.engine import StageSchedule
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.mixing import Mixer, largest_remainder, stage_weights
from proctor.server.state.rows import TransitionRecord

WriteCurriculum = Callable[..., Path]  # the conftest fixture's type


def rows(n: int) -> str:
    return "".join(json.dumps({"prompt": f"question {i}", "answer": str(i)}) + "\n" for i in range(n))


def single_stage() -> Callable[[int], int]:
    return lambda _iteration: 0


# --- largest_remainder ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "total", "rotation", "quotas"),
    [
        ([0.25, 0.75], 4, 0, [1, 3]),
        ([1.0], 7, 0, [7]),
        ([1.0], 0, 0, [0]),
        ([0.5, 0.5], 0, 0, [0, 0]),
        ([0.5, 0.5], 3, 0, [2, 1]),
        ([0.5, 0.5], 3, 1, [1, 2]),
        ([0.5, 0.5], 3, 2, [2, 1]),
        ([1 / 3, 1 / 3, 1 / 3], 4, 0, [2, 1, 1]),
        ([1 / 3, 1 / 3, 1 / 3], 4, 1, [1, 2, 1]),
        ([1 / 3, 1 / 3, 1 / 3], 4, 2, [1, 1, 2]),
        ([1 / 3, 1 / 3, 1 / 3], 5, 2, [2, 1, 2]),
        ([0.6, 0.3, 0.1], 10, 0, [6, 3, 1]),
        ([0.6, 0.3, 0.1], 3, 0, [2, 1, 0]),
        ([0.04, 0.96], 10, 0, [0, 10]),
        ([0.1, 0.1, 0.1, 0.7], 3, 1, [0, 1, 0, 2]),
    ],
    ids=[
        "quarter",
        "single",
        "zero-total-single",
        "zero-total",
        "tie-rot0",
        "tie-rot1",
        "tie-rot2",
        "thirds-rot0",
        "thirds-rot1",
        "thirds-rot2",
        "thirds-two-extra",
        "exact",
        "largest-remainder-wins",
        "small-share",
        "float-noise-tie",
    ],
)
def test_largest_remainder_examples(weights: list[float], total: int, rotation: int, quotas: list[int]) -> None:
    assert largest_remainder(weights, total, rotation) == quotas


@st.composite
def normalised_weights(draw: st.DrawFn) -> list[float]:
    raw = draw(st.lists(st.floats(min_value=1e-6, max_value=1e6), min_size=1, max_size=12))
    total = sum(raw)
    return [w / total for w in raw]


@settings(max_examples=300, deadline=None)
@given(weights=normalised_weights(), total=st.integers(1, 4096), rotation=st.integers(0, 10**6))
def test_largest_remainder_is_exact_and_fair(weights: list[float], total: int, rotation: int) -> None:
    quotas = largest_remainder(weights, total, rotation)
    assert len(quotas) == len(weights)
    assert sum(quotas) == total
    for q, w in zip(quotas, weights, strict=True):
        assert q >= 0
        assert abs(q - w * total) < 1


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 9), total=st.integers(0, 200))
def test_largest_remainder_ties_rotate(k: int, total: int) -> None:
    weights = [1 / k] * k
    per_rotation = [largest_remainder(weights, total, r) for r in range(k)]
    # Over k consecutive rotations every source is left short equally often: same total for each.
    assert [sum(col) for col in zip(*per_rotation, strict=True)] == [total] * k
    for r, quotas in enumerate(per_rotation):
        assert quotas == [total // k + ((i - r) % k < total % k) for i in range(k)]


# --- curricula for the Mixer ------------------------------------------------------------------------------


def _doc(sources: dict[str, Any], stages: list[dict[str, Any]], seed: int = 11) -> dict[str, Any]:
    return {"name": "mix", "seed": seed, "sources": sources, "stages": stages}


ARITH = {"kind": "arithmetic", "graders": ["numeric"]}


@pytest.fixture(scope="module")
def finite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Curriculum]:
    """A single-stage curriculum over one JSONL source of ``n`` rows (cached per n)."""
    cache: dict[int, Curriculum] = {}

    def make(n: int) -> Curriculum:
        if n not in cache:
            d = tmp_path_factory.mktemp(f"finite{n}")
            (d / "x.jsonl").write_text(rows(n), encoding="utf-8")
            doc = _doc(
                {"x": {"path": "x.jsonl", "graders": ["exact_match"]}},
                [{"name": "only", "until_step": 10**6, "mix": [{"source": "x"}]}],
            )
            (d / "c.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
            cache[n] = load_curriculum(d / "c.yaml")
        return cache[n]

    return make


@pytest.fixture
def staged(write_curriculum: WriteCurriculum) -> Curriculum:
    """Three stages, a finite and two procedural sources, replay in the last stage."""
    doc = _doc(
        {"f": {"path": "f.jsonl", "graders": ["exact_match"]}, "a": ARITH, "b": {**ARITH, "ops": ["*"]}},
        [
            {"name": "s0", "until_step": 40, "mix": [{"source": "f"}]},
            {"name": "s1", "until_step": 300, "mix": [{"source": "a", "weight": 3}, {"source": "f", "weight": 1}]},
            {
                "name": "s2",
                "until_step": 700,
                "mix": [{"source": "b", "weight": 1}, {"source": "a", "weight": 1}],
                "replay": 0.2,
            },
        ],
    )
    return load_curriculum(write_curriculum(doc, {"f.jsonl": rows(13)}))


def caps(curriculum: Curriculum) -> Callable[[int], int]:
    return StageSchedule(curriculum.stages).stage_of


# --- stage_weights ----------------------------------------------------------------------------------------


def test_stage_weights_without_replay_are_the_mix(staged: Curriculum) -> None:
    assert stage_weights(staged, 0) == (("f", 1.0),)
    assert stage_weights(staged, 1) == (("a", 0.75), ("f", 0.25))


def test_stage_weights_spread_replay_over_earlier_stages(staged: Curriculum) -> None:
    weights = dict(stage_weights(staged, 2))
    # 0.8 of the current mix (b 0.5, a 0.5); 0.1 of stage 0 (f 1.0); 0.1 of stage 1 (a 0.75, f 0.25).
    expected = {"b": 0.4, "a": 0.4 + 0.075, "f": 0.1 + 0.025}
    assert weights.keys() == expected.keys()
    for source, w in expected.items():
        assert weights[source] == pytest.approx(w)
    assert math.fsum(weights.values()) == pytest.approx(1.0)
    assert [s for s, _ in stage_weights(staged, 2)][:2] == ["b", "a"]  # the stage's own mix first


def test_stage_weights_of_the_shipped_style_replay_sum_to_one(write_curriculum: WriteCurriculum) -> None:
    stages = [
        {"name": f"s{i}", "until_step": 10 * (i + 1), "mix": [{"source": f"a{i}"}], "replay": 0.3 if i else 0}
        for i in range(5)
    ]
    cur = load_curriculum(write_curriculum(_doc({f"a{i}": ARITH for i in range(5)}, stages)))
    for stage in range(5):
        weights = dict(stage_weights(cur, stage))
        assert math.fsum(weights.values()) == pytest.approx(1.0)
        assert weights[f"a{stage}"] == pytest.approx(0.7 if stage else 1.0)
        assert set(weights) == {f"a{i}" for i in range(stage + 1)}
        for i in range(stage):
            assert weights[f"a{i}"] == pytest.approx(0.3 / stage)


# --- Mixer ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3, 10, 64])
def test_batch_holds_exactly_the_quotas(staged: Curriculum, batch_size: int) -> None:
    mixer = Mixer(staged)
    stage_of = caps(staged)
    for iteration in [*range(60), 299, 300, 301, 650]:
        picks = mixer.draw(iteration, batch_size, stage_of)
        quotas = mixer.quotas(stage_of(iteration), batch_size, iteration)
        assert sum(q for _, q in quotas) == batch_size
        assert Counter(s for s, _ in picks) == Counter({s: q for s, q in quotas if q})
        weights = dict(stage_weights(staged, stage_of(iteration)))
        for source, q in quotas:
            assert abs(q - weights[source] * batch_size) < 1


def test_stage_mix_decides_the_sources(staged: Curriculum) -> None:
    mixer = Mixer(staged)
    stage_of = caps(staged)
    assert {s for s, _ in mixer.draw(10, 32, stage_of)} == {"f"}
    assert {s for s, _ in mixer.draw(100, 32, stage_of)} == {"a", "f"}
    assert {s for s, _ in mixer.draw(400, 32, stage_of)} == {"a", "b", "f"}


def test_keys_are_valid_records(staged: Curriculum) -> None:
    mixer = Mixer(staged)
    stage_of = caps(staged)
    for iteration in range(0, 700, 7):
        for source, key in mixer.draw(iteration, 16, stage_of):
            staged.sources[source].record(key)  # raises KeyError for a key that is not there


def test_batch_order_is_mixed(staged: Curriculum) -> None:
    picks = Mixer(staged).draw(100, 64, caps(staged))
    order = [s for s, _ in picks]
    # 48 of `a` and 16 of `f`, interleaved rather than one block after the other.
    assert Counter(order) == {"a": 48, "f": 16}
    assert order != sorted(order)
    assert order != sorted(order, reverse=True)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), per_epoch=st.integers(1, 40), epochs=st.integers(1, 4))
def test_no_duplicate_inside_an_epoch_when_batches_tile_it(
    finite: Callable[[int], Curriculum], n: int, per_epoch: int, epochs: int
) -> None:
    # batch_size divides n, so each epoch is a whole number of batches.
    divisors = [b for b in range(1, n + 1) if n % b == 0]
    batch_size = divisors[per_epoch % len(divisors)]
    mixer = Mixer(finite(n))
    served = [key for i in range(epochs * n // batch_size) for _, key in mixer.draw(i, batch_size, single_stage())]
    assert len(served) == epochs * n
    for e in range(epochs):
        assert sorted(served[e * n : (e + 1) * n]) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), batch_size=st.integers(1, 48), iterations=st.integers(1, 30), offset=st.integers(0, 10**12)
)
def test_no_record_repeats_inside_a_batch_while_the_source_has_rows_enough(
    finite: Callable[[int], Curriculum], n: int, batch_size: int, iterations: int, offset: int
) -> None:
    mixer = Mixer(finite(n))
    for i in range(offset, offset + iterations):
        keys = [key for _, key in mixer.draw(i, batch_size, single_stage())]
        assert len(keys) == batch_size
        assert all(0 <= k < n for k in keys)
        if batch_size <= n:
            assert len(set(keys)) == batch_size, (i, keys)


def test_a_five_row_source_in_batches_of_three_never_repeats(finite: Callable[[int], Curriculum]) -> None:
    # The hostile-input run: 37 of the first 200 batches held one record twice before the boundary repair.
    mixer = Mixer(finite(5))
    for i in range(200):
        keys = [key for _, key in mixer.draw(i, 3, single_stage())]
        assert len(set(keys)) == 3, (i, keys)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch_size=st.integers(1, 48), iterations=st.integers(1, 30))
def test_a_batch_takes_the_next_entries_of_the_stream_repairing_only_an_epoch_boundary(
    finite: Callable[[int], Curriculum], n: int, batch_size: int, iterations: int
) -> None:
    cur = finite(n)
    # The source's stream before any repair: a batch of one never holds a record twice, so iteration p of
    # batch size 1 is position p of the stream (epoch p // n of the permutation), untouched.
    single = Mixer(cur)
    stream = [single.draw(p, 1, single_stage())[0][1] for p in range(batch_size * iterations)]
    mixer = Mixer(cur)
    for i in range(iterations):
        batch = sorted(key for _, key in mixer.draw(i, batch_size, single_stage()))
        start, stop = i * batch_size, (i + 1) * batch_size
        boundary = (start // n + 1) * n
        if stop <= boundary or batch_size > n:
            assert batch == sorted(stream[start:stop])  # untouched: inside one epoch, or too few rows
        else:
            old, new = stream[start:boundary], stream[boundary:stop]
            kept = [k for k in new if k not in old]
            added = Counter(batch) - Counter(old) - Counter(kept)
            # The old epoch's end is served whole; each repeat in the new epoch's start is replaced by a row
            # of the new epoch that this batch does not hold.
            assert Counter(batch) >= Counter(old) + Counter(kept)
            assert sum(added.values()) == len(new) - len(kept)
            assert not set(added) & set(old) and not set(added) & set(kept)


def test_an_epoch_boundary_still_serves_every_row_around_it(finite: Callable[[int], Curriculum]) -> None:
    # Two epochs' worth of batches of 7 over 20 rows: a row skipped at a boundary is served in the epoch after.
    n, b = 20, 7
    mixer = Mixer(finite(n))
    served = Counter(key for i in range(60) for _, key in mixer.draw(i, b, single_stage()))
    assert set(served) == set(range(n))
    assert max(served.values()) - min(served.values()) <= 6  # 21 epochs: each row within a few of 21


# `staged` is read-only here, so one instance may serve every example.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_size=st.integers(1, 70),
    iteration=st.integers(0, 900),
    gates=st.lists(st.integers(1, 800), max_size=2, unique=True),
)
def test_cursors_in_closed_form_equal_the_sum_of_every_earlier_quota(
    staged: Curriculum, batch_size: int, iteration: int, gates: list[int]
) -> None:
    records = [TransitionRecord(at, k, k + 1, "gate") for k, at in enumerate(sorted(gates))]
    stage_of = StageSchedule(staged.stages, records).stage_of
    mixer = Mixer(staged)
    walked: Counter[str] = Counter()
    for j in range(iteration):
        for source, q in mixer.quotas(stage_of(j), batch_size, j):
            walked[source] += q
    assert {s: c for s, c in mixer.cursors(iteration, batch_size, stage_of).items() if c} == +walked


@pytest.mark.timeout(10)
@pytest.mark.parametrize("iteration", [10**6, 2**53 - 1, 10**30], ids=["1e6", "2^53-1", "1e30"])
def test_any_iteration_is_drawn_without_walking_the_earlier_ones(staged: Curriculum, iteration: int) -> None:
    mixer = Mixer(staged)
    stage_of = caps(staged)
    picks = mixer.draw(iteration, 64, stage_of)
    assert len(picks) == 64
    for source, key in picks:
        staged.sources[source].record(key)
    assert Mixer(staged).draw(iteration, 64, stage_of) == picks


def test_epochs_are_different_orders(finite: Callable[[int], Curriculum]) -> None:
    # One record per batch, so the served order is the stream's own order, not the batch shuffle.
    mixer = Mixer(finite(50))
    stream = [mixer.draw(i, 1, single_stage())[0][1] for i in range(200)]
    epochs = {tuple(stream[e * 50 : (e + 1) * 50]) for e in range(4)}
    assert len(epochs) == 4
    assert tuple(range(50)) not in epochs


def test_procedural_sources_never_repeat_a_key(staged: Curriculum) -> None:
    mixer = Mixer(staged)
    stage_of = caps(staged)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for iteration in range(700):
        for source, key in mixer.draw(iteration, 7, stage_of):
            if source in seen:
                seen[source].append(key)
    for source, keys in seen.items():
        assert keys, source
        assert sorted(keys) == list(range(len(keys))), source  # each key once, none skipped


def test_two_fresh_mixers_draw_the_same(staged: Curriculum) -> None:
    reloaded = load_curriculum(staged.path)
    one, two = Mixer(staged), Mixer(reloaded)
    for iteration in [0, 1, 2, 39, 40, 41, 255, 256, 257, 699]:
        assert one.draw(iteration, 24, caps(staged)) == two.draw(iteration, 24, caps(reloaded))


def test_seed_changes_the_draws(staged: Curriculum) -> None:
    other = load_curriculum(staged.path, seed=staged.seed + 1)
    a = [Mixer(staged).draw(i, 13, caps(staged)) for i in range(5)]
    b = [Mixer(other).draw(i, 13, caps(other)) for i in range(5)]
    assert a != b


@pytest.mark.parametrize("target", [0, 37, 255, 256, 600], ids=str)
def test_draw_is_pure_in_the_iteration(staged: Curriculum, target: int) -> None:
    stage_of = caps(staged)
    walked = Mixer(staged)
    for iteration in range(target):
        walked.draw(iteration, 9, stage_of)
    assert Mixer(staged).draw(target, 9, stage_of) == walked.draw(target, 9, stage_of)


def test_draw_does_not_depend_on_request_order(staged: Curriculum) -> None:
    stage_of = caps(staged)
    fresh = {i: Mixer(staged).draw(i, 9, stage_of) for i in (5, 260, 300, 600)}
    jumpy = Mixer(staged)
    for i in (600, 5, 300, 260, 600, 5):
        assert jumpy.draw(i, 9, stage_of) == fresh[i], i


def test_each_batch_size_is_deterministic_on_its_own(staged: Curriculum) -> None:
    stage_of = caps(staged)
    sizes = [1, 4, 9, 32]
    separate = {b: [Mixer(staged).draw(i, b, stage_of) for i in range(0, 320, 29)] for b in sizes}
    shared = Mixer(staged)
    interleaved: dict[int, list[list[tuple[str, int]]]] = {b: [] for b in sizes}
    for i in range(0, 320, 29):
        for b in sizes:
            interleaved[b].append(shared.draw(i, b, stage_of))
    assert interleaved == separate
    assert separate[4] != [batch[:4] for batch in separate[32]]


def test_draw_follows_the_recorded_stage_history(staged: Curriculum) -> None:
    # A gate that ended stage 0 at iteration 10 changes the batches from 10 on, not before.
    gated = StageSchedule(staged.stages, [TransitionRecord(10, 0, 1, "gate")]).stage_of
    plain = caps(staged)
    for i in range(10):
        assert Mixer(staged).draw(i, 8, gated) == Mixer(staged).draw(i, 8, plain)
    assert {s for s, _ in Mixer(staged).draw(10, 8, gated)} == {"a", "f"}
    assert Mixer(staged).draw(50, 8, gated) != Mixer(staged).draw(50, 8, plain)
