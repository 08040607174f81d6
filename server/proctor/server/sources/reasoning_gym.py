"""Records from a reasoning-gym dataset (the optional ``reasoning-gym`` extra).

Record ``k`` is item ``k`` of ``reasoning_gym.create_dataset(dataset, seed=s, size=size, **config)``, where ``s`` is
derived from the curriculum's seed and the source's name. reasoning-gym derives item ``k`` from ``Random(s + k)``
alone (103 of its 106 datasets gave the same items in any order of access; list_functions did not), so records are
generated when first asked for and kept in a cache, not all at start-up: creating a dataset takes under 0.2 s for
nearly all of them, whatever the size, but one item takes from 0.02 ms (chain_sum) to 30 ms (countdown) or 130 ms
(futoshiki), which for 2000 records made up front would be minutes before the first batch.

reasoning-gym is imported when a source is built, never when this module is: curricula without such a source
load without the extra.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.metadata
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import REASONING_GYM_METADATA, import_reasoning_gym
from proctor.server.grading.builtin import reasoning_gym as grade_reasoning_gym
from proctor.server.sources.base import Record, Source, content_version
from proctor.server.sources.files import SourceDataError
from proctor.server.sources.knobs import config_knobs, reason
from proctor.server.spec import ReasoningGymSourceSpec

__all__ = ["ReasoningGymSource"]

# Bump when the mapping from items to records changes: the version (and so every sample id) changes with it.
_GENERATOR = "reasoning_gym/1"
# As for arithmetic: /grade looks up the records /sample just made, and some datasets take 30+ ms per item.
_CACHED_RECORDS = 4096
# proctor sets these itself: the seed from the curriculum's, the size from the source's own field.
_RESERVED = ("seed", "size")


class ReasoningGymSource(Source):
    """``size`` records of one reasoning-gym dataset; its config's knobs set the difficulty."""

    kind = "reasoning_gym"

    def __init__(self, name: str, spec: ReasoningGymSourceSpec, seed: int) -> None:
        try:
            rg = import_reasoning_gym("the reasoning_gym source kind")
        except ImportError as exc:
            raise SourceDataError("kind", str(exc)) from None
        package = importlib.metadata.version("reasoning-gym")
        super().__init__(name, content_version(_GENERATOR, package, seed, name, spec.dataset, spec.config, spec.size))
        self.spec = spec
        self._dataset = _create_dataset(rg, spec, _dataset_seed(seed, name), package)
        self._scoring = {"dataset": spec.dataset, "config": spec.config}
        self._difficulty = _knob_difficulty(rg, spec.dataset, self._dataset.config)
        # /grade looks up the records /sample just generated; regenerating one can cost more than keeping it.
        self.record = functools.lru_cache(maxsize=_CACHED_RECORDS)(self._generate)  # type: ignore[method-assign]
        self._check_grading()

    @property
    def size(self) -> int:
        return self.spec.size

    def record(self, key: int) -> Record:
        return self._generate(key)

    def derived_difficulty(self) -> float | None:
        """Where the config's knobs sit on the dataset's own curriculum, 0 (its first level) to 1 (its last).

        reasoning-gym gives most datasets a curriculum: per knob, a list of values from easy to hard. Each knob
        with such a list is placed on it: at a level's index when it equals that level's value, else, for
        numeric levels that strictly rise or fall, by linear interpolation between the two levels around it
        (clamped to the ends). A range knob (``min_x``/``max_x``) is placed by its upper end, as the curriculum
        sets it. The difficulty is the mean over the knobs placed, with the dataset's defaults for knobs the
        config leaves out; ``None`` when the dataset has no curriculum or no knob could be placed.

        The numbers compare sources of one dataset, not datasets with each other: the first level of one task
        may be harder than the last of another. Give sources a ``difficulty`` to rank datasets.
        """
        return self._difficulty

    def _generate(self, key: int) -> Record:
        if not 0 <= key < self.spec.size:
            raise KeyError(key)
        entry = self._dataset[key]
        metadata: dict[str, Any] = _json_safe(entry.get("metadata") or {})
        metadata[REASONING_GYM_METADATA] = self._scoring
        return Record(
            key=key,
            prompt=str(entry["question"]),
            answer=_answer_text(entry.get("answer")),
            system_prompt=self.spec.system_prompt,
            metadata=metadata,
        )

    def _check_grading(self) -> None:
        """Grade record 0's own answer as the grader will, so a dataset it cannot grade fails at load time.

        A record's metadata travels as JSON, which turns tuples into lists; a few scorers (arc_agi, rearc)
        compare against tuples and would give every right answer a low score.
        """
        dataset = self.spec.dataset
        try:
            record = self.record(0)
        except Exception as exc:  # reasoning-gym checks some knobs only when it generates an item
            raise SourceDataError(
                "config", f"reasoning-gym cannot generate {dataset!r} items with this config: {reason(exc)}"
            ) from None
        if record.answer is None:
            return  # a dataset with many right answers (propositional_logic, rubiks_cube): nothing to compare
        sample = GradeInput(
            prompt=record.prompt,
            completion=f"<answer>{record.answer}</answer>",
            answer=record.answer,
            metadata=json.loads(json.dumps(record.metadata)),
        )
        try:
            score = grade_reasoning_gym(sample)
        except Exception as exc:
            raise SourceDataError(
                "dataset", f"reasoning-gym's scorer fails on {dataset!r} record 0's own answer: {reason(exc)}"
            ) from None
        if score != 1.0:
            raise SourceDataError(
                "dataset",
                f"reasoning-gym's scorer gives {dataset!r} record 0's own answer {score}, not 1, once its metadata "
                "has been through JSON as every record's does; proctor cannot grade this dataset, choose another",
            )


def _dataset_seed(seed: int, name: str) -> int:
    """A seed per (curriculum seed, source name), so two sources of one dataset do not serve shifted copies.

    Below 2**31: reasoning-gym seeds item ``k`` with ``seed + k``, and some datasets hand that to numpy, which
    rejects seeds of 2**32 and more.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def _create_dataset(rg: Any, spec: ReasoningGymSourceSpec, seed: int, package: str) -> Any:
    datasets: Mapping[str, tuple[type, type]] = rg.factory.DATASETS
    if spec.dataset not in datasets:
        close = difflib.get_close_matches(spec.dataset, list(datasets), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise SourceDataError(
            "dataset",
            f"reasoning-gym {package} has no dataset {spec.dataset!r}{hint} "
            f"Its datasets: {', '.join(sorted(datasets))}",
        )
    knobs = config_knobs(datasets[spec.dataset][1], _RESERVED)
    listing = f"its knobs (with defaults): {', '.join(f'{k}={v!r}' for k, v in knobs.items())}"
    reserved = [k for k in _RESERVED if k in spec.config]
    if reserved:
        raise SourceDataError(
            "config",
            f"{' and '.join(reserved)} cannot be set in config: proctor derives the seed from the curriculum's "
            "seed and takes the size from the source's `size`",
        )
    unknown = [k for k in spec.config if k not in knobs]
    if unknown:
        raise SourceDataError("config", f"{spec.dataset!r} has no knob {', '.join(map(repr, unknown))}; {listing}")
    try:
        return rg.create_dataset(spec.dataset, seed=seed, size=spec.size, **spec.config)
    except Exception as exc:  # the config's own validate() asserts; constructors raise what they like
        raise SourceDataError(
            "config", f"reasoning-gym rejected the config of {spec.dataset!r}: {reason(exc)}; {listing}"
        ) from None


def _knob_difficulty(rg: Any, dataset: str, config: Any) -> float | None:
    factory = rg.factory
    if not factory.has_curriculum(dataset):
        return None
    positions: list[float] = []
    for attr in factory.create_curriculum(dataset).attributes.values():
        field = getattr(attr, "upper_field_name", None) or getattr(attr, "field_name", None)
        if field is None or not hasattr(config, field):
            continue
        position = _level_position(getattr(config, field), list(attr.levels))
        if position is not None:
            positions.append(position)
    return sum(positions) / len(positions) if positions else None


def _level_position(value: Any, levels: Sequence[Any]) -> float | None:
    """``value``'s place on ``levels``, from 0 (the first) to 1 (the last); ``None`` if it has none."""
    if len(levels) < 2:
        return None
    last = len(levels) - 1
    plain = _json_safe(value)
    for i, level in enumerate(levels):
        if _json_safe(level) == plain:
            return i / last
    if not (_is_number(value) and all(_is_number(v) for v in levels)):
        return None
    steps = list(itertools.pairwise(levels))
    if not (all(a < b for a, b in steps) or all(a > b for a, b in steps)):
        return None
    for i, (a, b) in enumerate(steps):
        if min(a, b) <= value <= max(a, b):
            return float(i + (value - a) / (b - a)) / last
    # Beyond the ends: the side it lies on is the side of the first level it lies past.
    below_first = (value < levels[0]) == (levels[0] < levels[1])
    return 0.0 if below_first else 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _answer_text(answer: Any) -> str | None:
    """The reference answer as text; ``None`` for datasets with many right answers, which score without one."""
    if answer is None:
        return None
    return str(answer) if isinstance(answer, str) else json.dumps(_json_safe(answer))


def _json_safe(value: Any) -> Any:
    """reasoning-gym's metadata holds tuples, sets and numpy scalars; the wire wants plain JSON."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)  # numpy's str_ too
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        # Sorted: a set of strings iterates in a different order in every process.
        return sorted((_json_safe(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):  # a numpy scalar
        try:
            return _json_safe(item())
        except (TypeError, ValueError):
            pass
    return str(value)
