"""Tests for the reasoning-gym source in :mod:`proctor.server.sources.reasoning_gym`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from proctor.server.curriculum.loader import load_curriculum
from proctor.server.shipped import builtin_path
from proctor.server.sources.base import SampleId, Source
from proctor.server.sources.files import SourceDataError
from proctor.server.sources.registry import build_source
from proctor.server.spec import CurriculumError, ReasoningGymSourceSpec, parse_spec

INSTALL = "pip install 'proctor[reasoning-gym]'"
SUMS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def make(dataset: str = "chain_sum", seed: int = 0, name: str = "rg", size: int = 50, **fields: Any) -> Source:
    fields.setdefault("config", SUMS if dataset == "chain_sum" else {})
    spec = ReasoningGymSourceSpec.model_validate(
        {"kind": "reasoning_gym", "dataset": dataset, "size": size, "graders": ["reasoning_gym"], **fields}
    )
    return build_source(name, spec, base_dir=Path("."), seed=seed)


def data_error(dataset: str = "chain_sum", **fields: Any) -> SourceDataError:
    with pytest.raises(SourceDataError) as info:
        make(dataset, **fields)
    return info.value


def prompts(src: Source, n: int = 20) -> list[str]:
    return [src.record(k).prompt for k in range(n)]


# --- records ----------------------------------------------------------------------------------------------


def test_records_are_the_datasets_items() -> None:
    src = make(size=50, system_prompt="Answer inside <answer></answer>.")
    assert (src.kind, src.size) == ("reasoning_gym", 50)
    record = src.record(7)
    assert record.key == 7
    assert record.prompt.startswith("State the final answer to the following arithmetic problem: ")
    assert record.answer == str(eval(record.metadata["expression"]))  # only digits, + and -
    assert record.system_prompt == "Answer inside <answer></answer>."
    assert record.metadata["source_dataset"] == "chain_sum"
    assert record.metadata["source_index"] == 7
    assert record.metadata["reasoning_gym"] == {"dataset": "chain_sum", "config": SUMS}


def test_records_are_deterministic_across_builds_and_access_orders() -> None:
    first = make(seed=5)
    forwards = [first.record(k) for k in range(30)]
    second = make(seed=5)
    backwards = [second.record(k) for k in reversed(range(30))][::-1]
    assert forwards == backwards


def test_records_depend_on_seed_and_name() -> None:
    base = prompts(make(seed=1, name="a"))
    assert len(set(base)) >= 15
    assert base != prompts(make(seed=2, name="a"))
    assert base != prompts(make(seed=1, name="b"))


def test_two_sources_of_one_dataset_do_not_serve_shifted_copies() -> None:
    # reasoning-gym seeds item k with seed + k; seeds that differ by a few would share most items. Long sums of
    # long numbers, so that no two items meet by chance.
    config = {"min_terms": 5, "max_terms": 6, "min_digits": 5, "max_digits": 6}
    a, b = prompts(make(name="a", config=config), 50), prompts(make(name="b", config=config), 50)
    assert not set(a) & set(b)


@pytest.mark.parametrize("key", [-1, 50, 51, 10**9], ids=str)
def test_keys_outside_the_size_raise_key_error(key: int) -> None:
    with pytest.raises(KeyError):
        make(size=50).record(key)


def test_metadata_is_plain_json() -> None:
    # knights_knaves keeps tuples and numpy strings in its metadata.
    src = make("knights_knaves", config={"n_people": 3})
    for key in range(5):
        metadata = src.record(key).metadata
        assert json.loads(json.dumps(metadata)) == metadata
        assert isinstance(metadata["solution"], list)


def test_datasets_without_one_answer_have_none() -> None:
    # propositional_logic accepts many conclusions; its scorer checks them without a reference.
    assert make("propositional_logic", size=5).record(0).answer is None


def test_records_are_made_when_asked_for() -> None:
    # countdown takes ~30 ms an item: a million of them made up front would take hours.
    started = time.perf_counter()
    src = make("countdown", size=1_000_000)
    assert src.record(999_999).answer
    assert time.perf_counter() - started < 20


def test_sample_id_round_trips() -> None:
    src = make()
    assert SampleId.parse(src.sample_id(3)) == SampleId("rg", src.version, 3)


# --- versions ---------------------------------------------------------------------------------------------


def test_version_is_stable() -> None:
    assert make(seed=3).version == make(seed=3).version


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 4},
        {"name": "other"},
        {"size": 51},
        {"config": {**SUMS, "max_digits": 3}},
        {"config": {**SUMS, "allow_negation": True}},
        {"dataset": "basic_arithmetic", "config": SUMS},
    ],
    ids=["seed", "name", "size", "knob", "another-knob", "dataset"],
)
def test_version_changes_with_what_makes_the_records(change: dict[str, Any]) -> None:
    assert make(**{"seed": 3, **change}).version != make(seed=3).version


def test_version_ignores_what_does_not_change_the_records() -> None:
    assert make(seed=3, on_error=-1.0, pass_threshold=0.5, difficulty=0.2).version == make(seed=3).version


# --- bad specs --------------------------------------------------------------------------------------------


def test_unknown_dataset_names_the_close_ones_and_lists_all() -> None:
    err = data_error("chain_sums", config={})
    assert err.field == "dataset"
    assert "has no dataset 'chain_sums'; did you mean 'chain_sum' or 'decimal_chain_sum'? Its datasets: " in str(err)
    assert ", basic_arithmetic, " in str(err)
    assert ", knights_knaves, " in str(err)


def test_unknown_knob_lists_the_knobs() -> None:
    err = data_error(config={"terms": 3})
    assert (err.field, str(err)) == (
        "config",
        "'chain_sum' has no knob 'terms'; its knobs (with defaults): "
        "min_terms=2, max_terms=6, min_digits=1, max_digits=4, allow_negation=False",
    )


def test_config_the_dataset_rejects() -> None:
    err = data_error(config={"min_terms": 4, "max_terms": 3})
    assert err.field == "config"
    assert str(err).startswith("reasoning-gym rejected the config of 'chain_sum': max_terms must be >= min_terms; ")
    assert "its knobs (with defaults): min_terms=2, max_terms=6" in str(err)


@pytest.mark.parametrize("knob", ["seed", "size"])
def test_seed_and_size_are_not_config(knob: str) -> None:
    err = data_error(config={knob: 1})
    assert (err.field, str(err)) == (
        "config",
        f"{knob} cannot be set in config: proctor derives the seed from the curriculum's seed and takes the size "
        "from the source's `size`",
    )


def test_a_dataset_whose_scorer_needs_tuples_is_refused() -> None:
    # rearc compares a parsed board (tuples) with metadata that JSON has turned into lists.
    err = data_error("rearc")
    assert err.field == "dataset"
    assert str(err) == (
        "reasoning-gym's scorer gives 'rearc' record 0's own answer 0.05, not 1, once its metadata has been "
        "through JSON as every record's does; proctor cannot grade this dataset, choose another"
    )


def test_without_reasoning_gym_the_kind_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    err = data_error()
    assert err.field == "kind"
    assert str(err).startswith("the reasoning_gym source kind needs reasoning-gym, which cannot be imported (")
    assert str(err).endswith(f"): {INSTALL}")


def test_curriculum_errors_name_the_field(tmp_path: Path) -> None:
    doc = {
        "name": "rg",
        "sources": {
            "typo": {"kind": "reasoning_gym", "dataset": "chain_sums", "graders": ["reasoning_gym"]},
            "knob": {"kind": "reasoning_gym", "dataset": "chain_sum", "config": {"x": 1}, "graders": ["reasoning_gym"]},
        },
        "stages": [{"name": "s", "until_step": 10, "mix": [{"source": "typo"}, {"source": "knob"}]}],
    }
    path = tmp_path / "rg.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(CurriculumError) as info:
        load_curriculum(path)
    assert sorted(p for p, _ in info.value.problems) == ["sources.knob.config", "sources.typo.dataset"]


# --- difficulty -------------------------------------------------------------------------------------------


def ladder_sources() -> dict[str, ReasoningGymSourceSpec]:
    path = builtin_path("reasoning_ladder")
    spec = parse_spec(yaml.safe_load(path.read_text()), file=str(path))
    return {name: src for name, src in spec.sources.items() if isinstance(src, ReasoningGymSourceSpec)}


def test_difficulty_rises_along_the_ladder_within_each_dataset() -> None:
    cur = load_curriculum(builtin_path("reasoning_ladder"))
    specs = ladder_sources()
    by_dataset: dict[str, list[float]] = {}
    seen: set[str] = set()
    for stage in cur.stages:
        for name, _ in stage.mix:
            if name in seen:
                continue
            seen.add(name)
            difficulty = cur.sources[name].source_difficulty()
            assert difficulty is not None and 0 <= difficulty <= 1, name
            by_dataset.setdefault(specs[name].dataset, []).append(difficulty)
    assert len(by_dataset) >= 3
    assert any(len(d) > 1 for d in by_dataset.values())
    for dataset, difficulties in by_dataset.items():
        assert difficulties == sorted(difficulties), dataset
        assert len(set(difficulties)) == len(difficulties), dataset


def _raised(config: dict[str, Any], knob: str) -> dict[str, Any]:
    return {**config, knob: config[knob] + 1}


@pytest.mark.parametrize("source", sorted(ladder_sources()))
def test_raising_any_upper_knob_of_a_ladder_source_raises_its_difficulty(source: str) -> None:
    spec = ladder_sources()[source]
    base = make(spec.dataset, config=spec.config).source_difficulty()
    assert base is not None
    for knob, value in spec.config.items():
        if isinstance(value, bool) or not isinstance(value, int) or knob.startswith("min_"):
            continue
        harder = make(spec.dataset, config=_raised(spec.config, knob)).source_difficulty()
        assert harder is not None and harder > base, knob


@pytest.mark.parametrize(
    ("dataset", "config", "expected"),
    [
        # num_terms levels 2..12, num_digits levels 1..10: each knob placed by its upper end.
        ("chain_sum", {"max_terms": 2, "max_digits": 1}, 0.0),
        ("chain_sum", {"max_terms": 12, "max_digits": 10}, 1.0),
        ("chain_sum", {"max_terms": 7, "max_digits": 1}, 0.25),
        ("chain_sum", {"max_terms": 40, "max_digits": 1}, 0.5),
        # n_people levels [2, 3, 4, 5]; depth and width [2, 3].
        ("knights_knaves", {"n_people": 3, "depth_constraint": 3, "width_constraint": 2}, (1 / 3 + 1) / 3),
        # numbers [3, 6, 9, 12, 15]: 4 is a third of the way to the second; target [100, 500, ...]; value [1, 100, ...].
        ("countdown", {"max_numbers": 4, "max_target": 500, "max_value": 100}, (1 / 12 + 1 / 4 + 1 / 3) / 3),
    ],
    ids=["easiest", "hardest", "between", "beyond-the-last", "knights", "countdown"],
)
def test_difficulty_is_the_mean_place_of_the_knobs_on_the_curriculum(
    dataset: str, config: dict[str, Any], expected: float
) -> None:
    assert make(dataset, config=config).source_difficulty() == pytest.approx(expected)


def test_difficulty_counts_the_defaults_of_knobs_left_out() -> None:
    # chain_sum defaults to 2..6 terms and 1..4 digits.
    assert make(config={}).source_difficulty() == pytest.approx((4 / 10 + 3 / 9) / 2)


def test_no_curriculum_no_difficulty() -> None:
    assert make("gsm_symbolic", size=5).source_difficulty() is None


def test_declared_difficulty_overrides_the_knobs() -> None:
    src = make(difficulty=0.9)
    assert src.source_difficulty() == 0.9
    assert src.derived_difficulty() == pytest.approx((1 / 10 + 1 / 9) / 2)
    assert src.record_difficulty(0) is None
