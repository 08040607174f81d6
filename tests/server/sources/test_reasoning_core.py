"""Tests for the reasoning-core source in :mod:`proctor.server.sources.reasoning_core`, task by task for every task
reasoning-core lists."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reasoning_core as rc
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.cli.main import main
from proctor.server.curriculum.loader import load_curriculum
from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import reasoning_core as grade
from proctor.server.sources.base import Record, SampleId, Source
from proctor.server.sources.files import SourceDataError
from proctor.server.sources.reasoning_core import _EXCLUDED, _TOP_LEVELS, _generator
from proctor.server.sources.registry import build_source
from proctor.server.spec import CurriculumError, ReasoningCoreSourceSpec

INSTALL = "pip install 'proctor[reasoning-core]'"
# Every task reasoning-core lists: those proctor serves are checked one by one, and the others are refused with the
# reason (their items depend on the machine's speed, or they need the network or reasoning-core's `gen` extra).
SERVED = sorted(t for t in rc.list_tasks() if t not in _EXCLUDED)
KEYS = 2


def top_level(task: str) -> int:
    return _TOP_LEVELS.get(task, (5, ""))[0]


# Each served task is checked at its lowest and highest level, on records 0..KEYS-1. The highest is the slowest: a
# few tasks take seconds an item there (constraint_satisfaction, parsing_derivation, syntax_error_detection).
CASES = [(task, level) for task in SERVED for level in (0, top_level(task))]


def make(task: str = "arithmetics", seed: int = 0, name: str = "rc", size: int = 50, **fields: Any) -> Source:
    spec = ReasoningCoreSourceSpec.model_validate(
        {"kind": "reasoning_core", "task": task, "size": size, "graders": ["reasoning_core"], **fields}
    )
    return build_source(name, spec, base_dir=Path("."), seed=seed)


def data_error(task: str = "arithmetics", **fields: Any) -> SourceDataError:
    with pytest.raises(SourceDataError) as info:
        make(task, **fields)
    return info.value


def graded(record: Record, answer: str | None) -> float:
    """The grader's score for ``answer`` in tags, with the record's metadata as it arrives: through JSON."""
    metadata = json.loads(json.dumps(record.metadata))
    completion = f"<think>Let me work it out.</think>\n<answer>{answer}</answer>"
    return grade(GradeInput(prompt=record.prompt, completion=completion, answer=record.answer, metadata=metadata))


def plain(record: Record) -> list[Any]:
    return [record.key, record.prompt, record.answer, dict(record.metadata)]


def prompts(src: Source, n: int = 20) -> list[str]:
    return [src.record(k).prompt for k in range(n)]


# --- every task ---------------------------------------------------------------------------------------------

# Another process, with another hash seed, makes the same records, in the other order: what a restarted server or
# a second replica serves. One run for every task and level, shared by the tests of each.
_OTHER_PROCESS = """
import json, sys
from pathlib import Path
from proctor.server.sources.registry import build_source
from proctor.server.spec import ReasoningCoreSourceSpec

cases, keys = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for task, level in cases:
    spec = ReasoningCoreSourceSpec.model_validate(
        {"kind": "reasoning_core", "task": task, "level": level, "size": 50, "graders": ["reasoning_core"]}
    )
    src = build_source("rc", spec, base_dir=Path("."), seed=0)
    made = [src.record(k) for k in reversed(range(keys))][::-1]
    out[f"{task}@{level}"] = [[r.key, r.prompt, r.answer, dict(r.metadata)] for r in made]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def other_process() -> dict[str, list[list[Any]]]:
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, json.dumps(CASES), str(KEYS)],
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    )
    made: dict[str, list[list[Any]]] = json.loads(done.stdout)
    return made


def test_every_task_reasoning_core_lists_is_served_or_refused() -> None:
    assert set(_EXCLUDED) < set(rc.list_tasks())
    assert len(SERVED) >= 30


@pytest.mark.timeout(900)  # the first one waits for the other process, about a minute
@pytest.mark.parametrize(("task", "level"), CASES)
def test_each_task_makes_the_same_records_everywhere_and_grades_its_own_answers(
    task: str, level: int, other_process: dict[str, list[list[Any]]]
) -> None:
    src = make(task, level=level)
    records = [src.record(k) for k in range(KEYS)]
    assert [plain(r) for r in records] == other_process[f"{task}@{level}"]
    for record in records:
        assert record.prompt and record.answer, (task, record.key)
        assert record.metadata["_task"] == task
        assert record.metadata["_level"] == level
        assert graded(record, record.answer) == 1.0, (task, record.key, record.answer)
        others = [r.answer for r in records if r.answer != record.answer]
        for wrong in [*others, ""]:
            assert graded(record, wrong) < 1.0, (task, record.key, wrong)


@pytest.mark.parametrize("task", sorted(_EXCLUDED))
def test_tasks_proctor_cannot_serve_are_refused_with_the_reason(task: str) -> None:
    err = data_error(task)
    assert (err.field, str(err)) == ("task", f"proctor cannot serve reasoning-core's {task!r}: {_EXCLUDED[task]}")


@pytest.mark.parametrize("task", sorted(_TOP_LEVELS))
def test_levels_too_slow_to_make_on_demand_are_refused(task: str) -> None:
    top, why = _TOP_LEVELS[task]
    err = data_error(task, level=top + 1)
    assert (err.field, str(err)) == ("level", f"proctor serves {task!r} up to level {top}: {why}")


# --- records ----------------------------------------------------------------------------------------------


def test_records_are_the_tasks_items() -> None:
    src = make(level=2, size=50, system_prompt="Answer inside <answer></answer>.")
    assert (src.kind, src.size) == ("reasoning_core", 50)
    record = src.record(7)
    assert record.key == 7
    assert record.prompt.startswith("Evaluate ")
    assert record.prompt.endswith("The answer is a number.")
    assert record.system_prompt == "Answer inside <answer></answer>."
    assert (record.metadata["_task"], record.metadata["_level"]) == ("arithmetics", 2)
    assert record.metadata["reasoning_core"] == {"task": "arithmetics", "level": 2, "config": {}}


def test_the_level_is_the_tasks_own() -> None:
    # arithmetics' level adds to its expressions' depth.
    assert make(level=0).record(0).metadata["_config"]["max_depth"] == 5
    assert make(level=3).record(0).metadata["_config"]["max_depth"] == 8


def test_config_knobs_reach_the_task_and_the_level_builds_on_them() -> None:
    record = make(level=1, config={"max_depth": 6, "semantics": "python"}).record(0)
    assert record.metadata["_config"]["max_depth"] == 7
    assert record.metadata["semantics"] == "python"
    assert record.metadata["reasoning_core"] == {
        "task": "arithmetics",
        "level": 1,
        "config": {"max_depth": 6, "semantics": "python"},
    }


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 29), min_size=1, max_size=8))
def test_a_record_is_the_same_whatever_was_made_before_it(keys: list[int]) -> None:
    in_order = make(seed=5, size=30)
    shuffled = make(seed=5, size=30)
    made = {k: shuffled.record(k) for k in keys}
    assert made == {k: in_order.record(k) for k in sorted(set(keys))}


def test_records_depend_on_seed_and_name() -> None:
    base = prompts(make(seed=1, name="a"))
    assert len(set(base)) >= 15
    assert base != prompts(make(seed=2, name="a"))
    assert base != prompts(make(seed=1, name="b"))


def test_a_record_made_on_another_thread_is_the_same() -> None:
    made: list[Record] = []
    thread = threading.Thread(target=lambda: made.extend(make(seed=3).record(k) for k in range(5)))
    thread.start()
    thread.join()
    src = make(seed=3)
    assert made == [src.record(k) for k in range(5)]


def test_making_records_leaves_the_processs_random_state_and_timers_alone() -> None:
    seeds = (random.Random.seed, np.random.default_rng)
    random.seed(9)
    np.random.seed(9)
    state, np_state = random.getstate(), np.random.get_state(legacy=True)
    previous = signal.setitimer(signal.ITIMER_REAL, 600)  # pytest-timeout's, if it runs with signals
    try:
        src = make(size=20)
        for k in range(20):
            src.record(k)
        # reasoning-core's generate_example would have cancelled it with alarm(0).
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *previous)
    assert random.getstate() == state
    after = np.random.get_state(legacy=True)
    assert isinstance(after, tuple) and isinstance(np_state, tuple)  # legacy=True: the MT19937 tuple
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]
    assert (random.Random.seed, np.random.default_rng) == seeds
    assert isinstance(random.seed, types.MethodType) and random.seed.__self__ is random._inst


def test_a_generator_process_that_died_is_started_again_and_makes_the_same_records() -> None:
    src = make(seed=4)
    first = [src.record(k) for k in range(3)]
    process = _generator()._process
    assert process is not None
    process.kill()
    process.wait()
    # The next request starts a new process, which makes the same records.
    again = make(seed=4)
    assert [again.record(k) for k in range(3)] == first
    assert _generator()._process is not process


@pytest.mark.parametrize("key", [-1, 50, 51, 10**9], ids=str)
def test_keys_outside_the_size_raise_key_error(key: int) -> None:
    with pytest.raises(KeyError):
        make(size=50).record(key)


def test_metadata_is_plain_json_without_what_says_how_the_record_was_made() -> None:
    metadata = make().record(0).metadata
    assert json.loads(json.dumps(metadata)) == metadata
    assert not {"_time", "_generator_commit", "_prompt_tokens", "_answer_tokens", "_cot_tokens"} & set(metadata)


def test_sample_id_round_trips() -> None:
    src = make()
    assert SampleId.parse(src.sample_id(3)) == SampleId("rc", src.version, 3)


def test_the_server_imports_without_reasoning_core() -> None:
    code = "import sys, proctor.server.app, proctor.server.sources.registry; print('reasoning_core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- versions ---------------------------------------------------------------------------------------------


def test_version_is_stable() -> None:
    assert make(seed=3).version == make(seed=3).version


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 4},
        {"name": "other"},
        {"size": 51},
        {"level": 1},
        {"config": {"max_depth": 6}},
        {"task": "math_word_problem"},
    ],
    ids=["seed", "name", "size", "level", "knob", "task"],
)
def test_version_changes_with_what_makes_the_records(change: dict[str, Any]) -> None:
    assert make(**{"seed": 3, **change}).version != make(seed=3).version


def test_version_ignores_what_does_not_change_the_records() -> None:
    assert make(seed=3, on_error=-1.0, pass_threshold=0.5, difficulty=0.2).version == make(seed=3).version


# --- bad specs --------------------------------------------------------------------------------------------


def test_unknown_task_names_the_close_ones_and_lists_those_served() -> None:
    err = data_error("arithmetic")
    assert err.field == "task"
    assert str(err).startswith(
        f"reasoning-core {rc.__version__} has no task 'arithmetic'; did you mean 'arithmetics'? "
        "The tasks proctor serves: analogical_case_matching, arithmetics, "
    )
    assert ", logic_qa, " in str(err)
    assert "coreference" not in str(err)


def test_unknown_knob_lists_the_knobs() -> None:
    err = data_error(config={"depth": 3})
    assert err.field == "config"
    assert str(err).startswith(
        "'arithmetics' has no knob 'depth'; its knobs (with defaults): min_depth=3, max_depth=5, "
    )


@pytest.mark.parametrize("knob", ["level", "seed", "size"])
def test_level_seed_and_size_are_not_config(knob: str) -> None:
    err = data_error(config={knob: 1})
    assert (err.field, str(err)) == (
        "config",
        f"{knob} cannot be set in config: proctor takes the level and the size from the source's own `level` and "
        "`size`, and derives the seed from the curriculum's seed",
    )


def test_a_config_the_task_rejects_when_built() -> None:
    err = data_error("constraint_satisfaction", config={"model_mode": "chess"})
    assert err.field == "config"
    assert str(err).startswith(
        "reasoning-core rejected the config of 'constraint_satisfaction': Unknown model_mode: 'chess'; its knobs"
    )


def test_a_config_the_task_cannot_generate_with() -> None:
    # A task reads its knobs only when it makes an item: the first record, made when the source is built, fails.
    err = data_error(config={"max_depth": "deep"})
    assert (err.field, str(err)) == (
        "config",
        "reasoning-core cannot generate 'arithmetics' items with this config: can only concatenate str (not \"int\") to str",
    )


@pytest.mark.parametrize(("level", "bound"), [(-1, "greater than or equal to 0"), (6, "less than or equal to 5")])
def test_levels_outside_0_to_5_are_refused_naming_the_field(
    tmp_path: Path, level: int, bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {
        "name": "rc",
        "sources": {
            "logic": {"kind": "reasoning_core", "task": "logic_qa", "level": level, "graders": ["reasoning_core"]}
        },
        "stages": [{"name": "s", "until_step": 10, "mix": [{"source": "logic"}]}],
    }
    path = tmp_path / "rc.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(CurriculumError) as info:
        load_curriculum(path)
    assert info.value.problems == [("sources.logic.level", f"Input should be {bound}")]
    assert main(["validate", str(path)]) == 2
    assert f"sources.logic.level: Input should be {bound}" in capsys.readouterr().err


def test_curriculum_errors_name_the_field(tmp_path: Path) -> None:
    doc = {
        "name": "rc",
        "sources": {
            "typo": {"kind": "reasoning_core", "task": "logic_q", "graders": ["reasoning_core"]},
            "knob": {"kind": "reasoning_core", "task": "logic_qa", "config": {"x": 1}, "graders": ["reasoning_core"]},
            "slow": {"kind": "reasoning_core", "task": "coreference", "graders": ["reasoning_core"]},
        },
        "stages": [
            {"name": "s", "until_step": 10, "mix": [{"source": "typo"}, {"source": "knob"}, {"source": "slow"}]}
        ],
    }
    path = tmp_path / "rc.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(CurriculumError) as info:
        load_curriculum(path)
    problems = dict(info.value.problems)
    assert sorted(problems) == ["sources.knob.config", "sources.slow.task", "sources.typo.task"]
    assert "has no task 'logic_q'; did you mean 'logic_qa'" in problems["sources.typo.task"]


def test_without_reasoning_core_the_kind_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_core", None)
    err = data_error()
    assert err.field == "kind"
    assert str(err).startswith("the reasoning_core source kind needs reasoning-core, which cannot be imported (")
    assert str(err).endswith(f"): {INSTALL}")


# --- difficulty -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", range(6))
def test_difficulty_is_the_level_over_5(level: int) -> None:
    src = make("logic_qa", level=level, size=5)
    assert src.source_difficulty() == level / 5
    assert src.record_difficulty(0) is None


def test_declared_difficulty_overrides_the_level() -> None:
    src = make(level=4, difficulty=0.1)
    assert (src.source_difficulty(), src.derived_difficulty()) == (0.1, 0.8)
