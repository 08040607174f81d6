"""Resolves the graders a curriculum names into what the pool and the remote client execute.

Local graders (built-in or custom Python) are described by a picklable :class:`LocalGrader` with a string
reference; each pool worker imports the reference once. Remote graders and LLM judges are called from the event
loop.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError

from proctor.server.exceptions import ProctorError
from proctor.server.grading.base import GradeInput, GraderFn
from proctor.server.spec import CustomGraderSpec, GraderUse, JudgeParams, JudgeSpec

__all__ = [
    "GraderResolutionError",
    "JudgeGrader",
    "LocalGrader",
    "RemoteGrader",
    "SourceGraders",
    "load_callable",
    "local_refs",
    "prepare_grader",
    "resolve_graders",
]

BUILTIN_PREFIX = "builtin:"


class GraderResolutionError(ProctorError, ValueError):
    """A grader that a curriculum names but cannot be used: ``index`` is its position in the source's list,
    ``field`` the faulty field of that entry."""

    def __init__(self, field: str, message: str, index: int = 0) -> None:
        self.field = field
        self.index = index
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class LocalGrader:
    key: str
    ref: str
    params: Mapping[str, Any]
    weight: float
    multiplicative: bool


@dataclass(frozen=True, slots=True)
class RemoteGrader:
    key: str
    url: str
    timeout_s: float
    headers: Mapping[str, str]
    params: Mapping[str, Any]
    weight: float
    multiplicative: bool


@dataclass(frozen=True, slots=True)
class JudgeGrader:
    """An LLM judge as a source uses it (:mod:`proctor.server.grading.judge`): ``name`` is the judge's name under
    the curriculum's ``graders``, whose ``max_concurrency`` every source that uses it shares; ``rubric``,
    ``score_pattern`` and ``scale`` are the source's own when its use of the judge sets them."""

    key: str
    name: str
    url: str
    model: str
    rubric: str
    score_pattern: str
    scale: tuple[float, float]
    max_concurrency: int
    timeout_s: float
    deadline_s: float
    retries: int
    max_tokens: int
    temperature: float
    weight: float
    multiplicative: bool


@dataclass(frozen=True, slots=True)
class SourceGraders:
    """Everything needed to turn one completion of a source into a reward."""

    local: tuple[LocalGrader, ...]
    remote: tuple[RemoteGrader, ...]
    on_error: float
    names: tuple[str, ...] = field(default=())
    judges: tuple[JudgeGrader, ...] = field(default=())


def local_refs(graders: Mapping[str, SourceGraders]) -> list[str]:
    """The references of the sources' local graders (those a grader process runs), each once."""
    return list(dict.fromkeys(g.ref for source in graders.values() for g in source.local))


def load_callable(ref: str) -> GraderFn:
    """Import what a reference names: ``builtin:name``, ``module:attr`` or ``/abs/file.py:attr``."""
    if ref.startswith(BUILTIN_PREFIX):
        from proctor.server.grading.builtin import BUILTIN_GRADERS

        return BUILTIN_GRADERS[ref.removeprefix(BUILTIN_PREFIX)]
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py"):
        # A stable module name per file, so every worker (and a re-load) sees one module, not copies.
        mod_name = "proctor_grader_" + hashlib.sha256(target.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, target)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{ref} is a {type(fn).__name__}, not a function")
    return cast(GraderFn, fn)


def prepare_grader(ref: str) -> GraderFn:
    """The grader ``ref`` names, imported, with what a built-in one builds on its first call built ahead
    (math-verify's parser, for ``math``): a grader process does this before it grades, so that no completion's
    time limit pays for an import."""
    fn = load_callable(ref)
    if ref.startswith(BUILTIN_PREFIX):
        from proctor.server.grading.builtin import PREPARE

        prepare = PREPARE.get(ref.removeprefix(BUILTIN_PREFIX))
        if prepare is not None:
            prepare()
    return fn


def resolve_graders(
    uses: list[GraderUse],
    custom: Mapping[str, CustomGraderSpec],
    *,
    on_error: float,
    base_dir: Path,
) -> SourceGraders:
    """Resolve a source's grader list; raises :class:`GraderResolutionError` naming the faulty part."""
    local: list[LocalGrader] = []
    remote: list[RemoteGrader] = []
    judges: list[JudgeGrader] = []
    for index, use in enumerate(uses):
        try:
            if use.name in custom and (judge := custom[use.name].judge) is not None:
                judges.append(_judge(use, judge))
            else:
                _resolve_one(use, custom, base_dir, local, remote)
        except GraderResolutionError as exc:
            exc.index = index
            raise
    return SourceGraders(tuple(local), tuple(remote), on_error, tuple(u.key for u in uses), tuple(judges))


def _judge(use: GraderUse, spec: JudgeSpec) -> JudgeGrader:
    """A source's use of a judge, with the ``rubric``, ``score_pattern`` and ``scale`` its ``params`` set."""
    try:
        own = JudgeParams.model_validate(use.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(["params", *(str(p) for p in err["loc"])])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = f"judge {use.name!r} takes only rubric, score_pattern and scale in a source's params"
        raise GraderResolutionError(where, message) from None
    return JudgeGrader(
        key=use.key,
        name=use.name,
        url=spec.url,
        model=spec.model,
        rubric=spec.rubric if own.rubric is None else own.rubric,
        score_pattern=spec.score_pattern if own.score_pattern is None else own.score_pattern,
        scale=spec.scale if own.scale is None else own.scale,
        max_concurrency=spec.max_concurrency,
        timeout_s=spec.timeout_s,
        deadline_s=spec.deadline_s,
        retries=spec.retries,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        weight=use.weight,
        multiplicative=use.multiplicative,
    )


def _resolve_one(
    use: GraderUse,
    custom: Mapping[str, CustomGraderSpec],
    base_dir: Path,
    local: list[LocalGrader],
    remote: list[RemoteGrader],
) -> None:
    from proctor.server.grading.builtin import BUILTIN_GRADERS

    if use.name in custom:
        spec = custom[use.name]
        params = {**spec.params, **use.params}
        if spec.url is not None:
            remote.append(
                RemoteGrader(use.key, spec.url, spec.timeout_s, spec.headers, params, use.weight, use.multiplicative)
            )
            return
        assert spec.python is not None
        ref = _absolute_ref(spec.python, base_dir)
    elif use.name in BUILTIN_GRADERS:
        ref, params = BUILTIN_PREFIX + use.name, dict(use.params)
    else:
        known = ", ".join([*sorted(BUILTIN_GRADERS), *sorted(custom)])
        raise GraderResolutionError(
            "name", f"unknown grader {use.name!r}; use a built-in one or declare it under `graders` ({known})"
        )
    try:
        fn = load_callable(ref)
    except Exception as exc:
        raise GraderResolutionError("name", f"cannot import grader {use.name!r} from {ref!r}: {exc}") from None
    _check_params(use.name, fn, params)
    local.append(LocalGrader(use.key, ref, params, use.weight, use.multiplicative))


def _absolute_ref(ref: str, base_dir: Path) -> str:
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py"):
        return f"{(base_dir / target).resolve()}:{attr}"
    return ref


def _check_params(name: str, fn: GraderFn, params: Mapping[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some callables have no introspectable signature
        return
    try:
        sig.bind(GradeInput(prompt="", completion=""), **params)
    except TypeError as exc:
        accepted = [p.name for p in list(sig.parameters.values())[1:] if p.kind is not p.VAR_KEYWORD]
        raise GraderResolutionError(
            "params", f"grader {name!r}: {exc} (accepted params: {', '.join(accepted) or 'none'})"
        ) from None
