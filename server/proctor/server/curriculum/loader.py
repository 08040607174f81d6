"""Loads a curriculum file into a ready-to-serve :class:`Curriculum`: sources read, graders resolved, hashed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from proctor.server.grading.code import read_tests
from proctor.server.grading.registry import BUILTIN_PREFIX, GraderResolutionError, SourceGraders, resolve_graders
from proctor.server.sources.base import Source
from proctor.server.sources.files import SourceDataError
from proctor.server.sources.registry import build_source
from proctor.server.spec import (
    AdvanceGate,
    CurriculumError,
    CurriculumSpec,
    RefillSpec,
    TargetDifficultySamplerSpec,
    read_spec,
    stage_sources,
)

__all__ = ["Curriculum", "Stage", "load_curriculum"]


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    name: str
    until_step: int
    mix: tuple[tuple[str, float], ...]  # weights normalised to sum to 1
    replay: float
    advance: AdvanceGate | None
    refill: RefillSpec | None = None


@dataclass(frozen=True, slots=True)
class Curriculum:
    """Everything the server needs, immutable once loaded."""

    name: str
    path: Path
    seed: int
    hash: str
    system_prompt: str | None
    stages: tuple[Stage, ...]
    sources: dict[str, Source]
    graders: dict[str, SourceGraders]
    spec: CurriculumSpec

    @property
    def total_iterations(self) -> int:
        return self.stages[-1].until_step

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(stage.name for stage in self.stages)


def load_curriculum(path: str | Path, *, seed: int | None = None) -> Curriculum:
    """Read, validate and build a curriculum; every problem is reported with its YAML path.

    ``seed`` overrides the file's own seed (and so changes the hash and every procedural record).
    """
    path = Path(path)
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CurriculumError([("", f"cannot read the file: {exc.strerror or exc}")], file=shown) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CurriculumError([("", f"not valid YAML: {exc}")], file=shown) from None
    parts = read_spec(data)
    seed = parts.seed if seed is None else seed
    base_dir = path.resolve().parent

    problems = list(parts.problems)
    sources: dict[str, Source] = {}
    graders: dict[str, SourceGraders] = {}
    for name, src_spec in parts.sources.items():
        try:
            sources[name] = build_source(name, src_spec, base_dir=base_dir, seed=seed)
        except SourceDataError as exc:
            problems.append((f"sources.{name}.{exc.field}", str(exc)))
        if parts.graders is None:
            continue  # a custom grader did not parse: resolving against the rest would report it missing
        try:
            graders[name] = resolve_graders(
                src_spec.graders, parts.graders, on_error=src_spec.on_error, base_dir=base_dir
            )
        except GraderResolutionError as exc:
            problems.append((f"sources.{name}.graders[{exc.index}].{exc.field}", str(exc)))
            continue
        if name in sources:
            problems.extend(_code_problems(name, sources[name], graders[name]))
    spec = parts.spec
    if spec is not None and not problems:
        spec = spec.model_copy(update={"seed": seed})
        problems.extend(_difficulty_problems(spec, sources))
    if problems or spec is None:
        raise CurriculumError(problems, file=shown)

    stages = tuple(
        Stage(
            index=i,
            name=st.name,
            until_step=st.until_step,
            mix=_normalise([(m.source, m.weight) for m in st.mix]),
            replay=st.replay,
            advance=st.advance,
            refill=st.refill,
        )
        for i, st in enumerate(spec.stages)
    )
    return Curriculum(
        name=spec.name,
        path=path.resolve(),
        seed=spec.seed,
        hash=_hash(spec, sources),
        system_prompt=spec.system_prompt,
        stages=stages,
        sources=sources,
        graders=graders,
        spec=spec,
    )


def _code_problems(name: str, source: Source, graders: SourceGraders) -> list[tuple[str, str]]:
    """A source graded by ``code`` needs tests in every record: checked here, not at the first completion."""
    problems = []
    for grader in graders.local:
        if grader.ref != BUILTIN_PREFIX + "code":
            continue
        field = str(grader.params.get("tests_field", "tests"))
        where = f"sources.{name}.graders[{graders.names.index(grader.key)}]"
        if source.size is None:
            problems.append((where, f"source {name!r} is endless; the code grader needs records with tests"))
            continue
        for key in range(source.size):
            try:
                read_tests(source.record(key).metadata.get(field))
            except ValueError as exc:
                problems.append((where, f"record {key}'s {field!r} {exc}"))
                break
    return problems


def _difficulty_problems(spec: CurriculumSpec, sources: dict[str, Source]) -> list[tuple[str, str]]:
    """A ``target_difficulty`` stage reading each source's difficulty needs one from every source it serves:
    declared, or derived from a procedural source's knobs (which only the built source knows)."""
    problems = []
    for i, stage in enumerate(spec.stages):
        sampler = stage.sampler
        if not isinstance(sampler, TargetDifficultySamplerSpec) or sampler.params.difficulty != "source":
            continue
        for name in stage_sources(spec.stages, i):
            if sources[name].source_difficulty() is None:
                problems.append(
                    (
                        f"stages[{i}].sampler.params.difficulty",
                        f"`source` reads each source's difficulty, and sources.{name} derives none from its knobs: "
                        "give it `difficulty: <number>`",
                    )
                )
    return problems


def _normalise(pairs: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    total = sum(w for _, w in pairs)
    return tuple((s, w / total) for s, w in pairs)


def _hash(spec: CurriculumSpec, sources: dict[str, Source]) -> str:
    """Content hash: the validated spec (seed included) plus every source's data version."""
    doc = {
        # Defaults left out: a curriculum that spells one out is the same curriculum as one that omits it,
        # and a setting added to proctor later does not change the hash of the curricula written before it.
        "spec": spec.model_dump(mode="json", exclude_defaults=True),
        "sources": {name: src.version for name, src in sorted(sources.items())},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
