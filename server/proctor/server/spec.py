"""The curriculum file format: pydantic models for the YAML, and errors that name their YAML path.

A curriculum is one YAML file::

    name: arithmetic
    seed: 17
    system_prompt: Answer with the number only.
    sources:
      add_1d: {kind: arithmetic, ops: ["+"], digits: [1, 1], graders: [numeric]}
      words:  {path: data/word_problems.jsonl, prompt_field: question, graders: [math]}
    graders:                                   # custom graders, optional
      judge: {python: "my_pkg.judges:score"}
    statistics: {decay: 0.8}                   # per-item pass-rate posteriors, optional
    stages:
      - name: warmup
        until_step: 40
        mix: [{source: add_1d, weight: 1.0}]
        advance: {threshold: 0.8, window: 64, min_steps: 10}
      - name: mixed
        until_step: 200
        mix: [{source: add_1d, weight: 0.25}, {source: words, weight: 0.75}]
        replay: 0.1
        sampler: {kind: learnability, params: {explore: 0.05}}

Structural checks happen here; checks that need the file system or imports (data files, custom graders)
happen in :mod:`proctor.server.curriculum.loader`, which reports them the same way.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from proctor.server.exceptions import ProctorError

__all__ = [
    "AdvanceGate",
    "ArithmeticSourceSpec",
    "CurriculumError",
    "CurriculumSpec",
    "CustomGraderSpec",
    "FileSourceSpec",
    "FixedMixingSpec",
    "GraderUse",
    "ItemStatisticsSpec",
    "JudgeParams",
    "JudgeSpec",
    "LearnabilityParams",
    "LearnabilitySamplerSpec",
    "LearningProgressMixingSpec",
    "LearningProgressParams",
    "MeanRewardOutsideRefillSpec",
    "MixEntry",
    "MixingSpec",
    "ReasoningCoreSourceSpec",
    "ReasoningGymSourceSpec",
    "RefillSpec",
    "SamplerSpec",
    "SkipZeroVarianceParams",
    "SkipZeroVarianceSamplerSpec",
    "SourceSpec",
    "SpecParts",
    "StageSpec",
    "TargetDifficultyParams",
    "TargetDifficultySamplerSpec",
    "UniformParams",
    "UniformSamplerSpec",
    "ZeroVarianceRefillSpec",
    "format_loc",
    "judge_rubric_problem",
    "parse_spec",
    "read_spec",
    "stage_sources",
]

T = TypeVar("T")

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_NAME = re.compile(NAME_PATTERN)
_FILE_KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".csv": "csv"}
_UNION_TAGS = {"arithmetic", "reasoning_gym", "reasoning_core", *_FILE_KINDS.values()}
_SAMPLER_TAGS = {"uniform", "learnability", "skip_zero_variance", "target_difficulty"}
_MIXING_TAGS = {"fixed", "learning_progress"}
_REFILL_TAGS = {"zero_variance", "mean_reward_outside"}
_STAGE_TAGS = (
    {("sampler", tag) for tag in _SAMPLER_TAGS}
    | {("mixing", tag) for tag in _MIXING_TAGS}
    | {("refill", tag) for tag in _REFILL_TAGS}
)


class CurriculumError(ProctorError, ValueError):
    """A curriculum that cannot be loaded. ``problems`` holds ``(yaml_path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], *, file: str | None = None) -> None:
        self.problems = problems
        self.file = file
        head = f"invalid curriculum {file}" if file else "invalid curriculum"
        lines = [f"{path}: {msg}" if path else msg for path, msg in problems]
        super().__init__(head + ":\n  " + "\n  ".join(lines))

    @classmethod
    def from_validation(cls, exc: ValidationError, *, file: str | None = None) -> CurriculumError:
        problems = []
        for err in exc.errors():
            loc = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
            # A source's discriminated union puts the chosen kind right after the source name; the author
            # never wrote it. Only that position: a source may well be *named* "arithmetic".
            if len(loc) > 2 and loc[0] == "sources" and loc[2] in _UNION_TAGS:
                del loc[2]
            # Likewise a stage's sampler (`stages[1].sampler.learnability.params` → `stages[1].sampler.params`)
            # and its mixing and refill.
            if len(loc) > 3 and loc[0] == "stages" and (loc[2], loc[3]) in _STAGE_TAGS:
                del loc[3]
            problems.append((format_loc(loc), _clean_msg(err["msg"])))
        return cls(problems, file=file)


def format_loc(loc: list[int | str] | tuple[int | str, ...]) -> str:
    """``('stages', 1, 'mix', 0, 'source')`` → ``stages[1].mix[0].source``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _clean_msg(msg: str) -> str:
    return msg.removeprefix("Value error, ")


class _Spec(BaseModel):
    # Typos in a curriculum must fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class GraderUse(_Spec):
    """One grader applied to a source's completions."""

    name: str = Field(description="A built-in grader or one declared under the top-level `graders`.")
    id: str | None = Field(default=None, description="Key in the result's components; defaults to name.")
    weight: float = Field(default=1.0, ge=0)
    multiplicative: bool = Field(default=False, description="Multiply the reward instead of adding to it.")
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.id or self.name


def _grader_shorthand(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class _SourceBase(_Spec):
    graders: list[GraderUse] = Field(min_length=1)
    on_error: float = Field(default=0.0, description="Reward of a completion whose grading failed.")
    system_prompt: str | None = None
    pass_threshold: float = Field(
        default=1.0, description="A completion passes when its reward is at least this (the per-item pass rate)."
    )
    difficulty: float | None = Field(
        default=None,
        description="This source's difficulty, for `target_difficulty` samplers with `difficulty: source`; "
        "procedural sources derive one from their knobs when it is not given.",
    )

    @field_validator("graders", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return [_grader_shorthand(v) for v in value] if isinstance(value, list) else value

    @field_validator("graders")
    @classmethod
    def _unique_keys(cls, graders: list[GraderUse]) -> list[GraderUse]:
        seen: set[str] = set()
        for g in graders:
            if g.key in seen:
                raise ValueError(f"grader {g.key!r} is listed twice; give one of them an `id`")
            seen.add(g.key)
        if all(g.multiplicative for g in graders):
            raise ValueError("at least one grader must be additive (multiplicative: false)")
        if sum(g.weight for g in graders if not g.multiplicative) <= 0:
            raise ValueError("the additive graders' weights sum to 0; give at least one a positive weight")
        return graders


class ArithmeticSourceSpec(_SourceBase):
    """Procedurally generated arithmetic with difficulty knobs; infinite and dependency-free."""

    kind: Literal["arithmetic"]
    ops: list[Literal["+", "-", "*"]] = Field(default=["+"], min_length=1)
    digits: tuple[int, int] = Field(default=(1, 1), description="Inclusive range of digits per operand.")
    operands: int = Field(default=2, ge=2, le=8)
    allow_negative: bool = Field(default=False, description="Let subtraction go below zero.")
    template: str = Field(default="What is {expression}?", description="Prompt; `{expression}` is filled in.")
    size: int | None = Field(
        default=None,
        ge=1,
        le=10**9,
        description="Serve records 0..size-1 in seeded epochs, like a file, instead of an endless stream; "
        "adaptive samplers need a finite source.",
    )

    @field_validator("digits")
    @classmethod
    def _digit_range(cls, digits: tuple[int, int]) -> tuple[int, int]:
        lo, hi = digits
        if not 1 <= lo <= hi <= 18:
            raise ValueError(f"must be [min, max] with 1 ≤ min ≤ max ≤ 18, got [{lo}, {hi}]")
        return digits

    @field_validator("template")
    @classmethod
    def _has_placeholder(cls, template: str) -> str:
        if "{expression}" not in template:
            raise ValueError("must contain the placeholder {expression}")
        return template


class FileSourceSpec(_SourceBase):
    """Records from a local JSONL, Parquet or CSV file (path relative to the curriculum file)."""

    kind: Literal["jsonl", "parquet", "csv"]
    path: str
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    system_prompt_field: str | None = None
    metadata_fields: list[str] | None = Field(
        default=None, description="Fields copied into each sample's metadata; default: all other fields."
    )
    difficulty_field: str | None = Field(
        default=None, description="A numeric field holding each record's difficulty (`difficulty: record`)."
    )


class ReasoningGymSourceSpec(_SourceBase):
    """A reasoning-gym dataset (the optional ``reasoning-gym`` extra): ``size`` records generated from the
    curriculum's seed, with the dataset's own config as its difficulty knobs."""

    kind: Literal["reasoning_gym"]
    dataset: str = Field(pattern=r"^[a-z0-9_]+$", description="A reasoning-gym dataset name, e.g. basic_arithmetic.")
    config: dict[str, Any] = Field(default_factory=dict, description="The dataset's config: its difficulty knobs.")
    size: int = Field(default=1000, ge=1, le=1_000_000, description="Records generated (keys 0..size-1).")


class ReasoningCoreSourceSpec(_SourceBase):
    """A reasoning-core task (the optional ``reasoning-core`` extra): ``size`` records generated from the
    curriculum's seed at the task's difficulty ``level``, which is also the source's difficulty."""

    kind: Literal["reasoning_core"]
    task: str = Field(pattern=r"^[a-z0-9_]+$", description="A reasoning-core task name, e.g. arithmetics.")
    level: int = Field(default=0, ge=0, le=5, description="The task's difficulty level, 0 (easiest) to 5.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The task's config knobs besides the level (the level builds on them)."
    )
    size: int = Field(default=1000, ge=1, le=1_000_000, description="Records generated (keys 0..size-1).")


SourceSpec = Annotated[
    ArithmeticSourceSpec | FileSourceSpec | ReasoningGymSourceSpec | ReasoningCoreSourceSpec,
    Field(discriminator="kind"),
]


# What a judge's rubric may name; {response} is the completion after a leading <think>…</think> block.
JUDGE_PLACEHOLDERS = ("prompt", "completion", "response", "answer")
DEFAULT_JUDGE_RUBRIC = """You are grading a response to a task.

[Task]
{prompt}

[Response]
{response}

Rate how well the response accomplishes the task, from 0 (wrong or useless) to 10 (fully correct and helpful). \
Explain your rating in a few sentences, then end with a line of the form "Score: N"."""
# "Score: 7", "score = 7.5", "**Score:** 7" or "[[7]]"; the last match in the judge's answer is its score.
DEFAULT_JUDGE_SCORE_PATTERN = r"(?i)(?:\bscore\b[\s*_]{0,4}[:=][\s*_]{0,4}|\[\[\s*)(-?\d+(?:\.\d+)?)"


def judge_rubric_problem(template: str) -> str | None:
    """Why ``template`` cannot be a judge's rubric (an unknown placeholder, say), or None when it can."""
    allowed = ", ".join("{" + p + "}" for p in JUDGE_PLACEHOLDERS)
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"not a valid template ({exc}); write {{{{ and }}}} for a literal brace"
    for name, spec, conversion in fields:
        if name not in JUDGE_PLACEHOLDERS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            return f"unknown placeholder {shown}; a rubric may name {allowed} (write {{{{ and }}}} for a literal brace)"
    if not {"completion", "response"} & {name for name, _, _ in fields}:
        return "names neither {completion} nor {response}: the judge would never see the completion"
    return None


def _rubric(template: str | None) -> str | None:
    if template is not None and (problem := judge_rubric_problem(template)) is not None:
        raise ValueError(problem)
    return template


def _score_pattern(pattern: str | None) -> str | None:
    if pattern is None:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    if compiled.groups != 1:
        raise ValueError(f"must have exactly one group, the score; it has {compiled.groups}")
    return pattern


def _scale(scale: tuple[float, float] | None) -> tuple[float, float] | None:
    if scale is not None and not (math.isfinite(scale[0]) and math.isfinite(scale[1]) and scale[0] < scale[1]):
        raise ValueError(f"must be [min, max] with min < max, got {list(scale)}")
    return scale


class JudgeSpec(_Spec):
    """An LLM judge behind any OpenAI-compatible endpoint: each completion is one ``POST {url}/chat/completions``
    whose single user message is the rubric filled in; the score is read from the answer and scaled to 0..1."""

    url: str = Field(
        pattern=r"^https?://[^\s]+$",
        description="The endpoint's base URL, e.g. http://vllm:8000/v1; the request goes to {url}/chat/completions.",
    )
    model: str = Field(min_length=1, description="The model the endpoint serves, as its API names it.")
    rubric: str = Field(
        default=DEFAULT_JUDGE_RUBRIC,
        description="The judge's prompt, with {prompt}, {completion}, {response} (the completion after a leading "
        "<think>…</think> block) and {answer} (the record's reference answer) filled in.",
    )
    score_pattern: str = Field(
        default=DEFAULT_JUDGE_SCORE_PATTERN,
        description="A regular expression with one group, the score; its last match in the answer counts.",
    )
    scale: tuple[float, float] = Field(default=(0.0, 10.0), description="[min, max] of the judge's scores; → 0..1.")
    max_concurrency: int = Field(
        default=8, ge=1, le=256, description="Most requests in flight to this judge, over every /grade at once."
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Time limit of one request to the judge.")
    deadline_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="Longest a completion waits for its verdict, waits for a free slot and retries included.",
    )
    retries: int = Field(default=3, ge=0, le=10, description="Tries again after a 429, a 5xx or a connection error.")
    max_tokens: int = Field(default=512, ge=1, le=1_000_000, description="The judge's longest answer, in tokens.")
    temperature: float = Field(default=0.0, ge=0, le=2)

    _check_rubric = field_validator("rubric")(_rubric)
    _check_pattern = field_validator("score_pattern")(_score_pattern)
    _check_scale = field_validator("scale")(_scale)

    @model_validator(mode="after")
    def _deadline_fits(self) -> JudgeSpec:
        if self.deadline_s < self.timeout_s:
            raise ValueError(f"deadline_s ({self.deadline_s:g}) is below timeout_s ({self.timeout_s:g})")
        return self


class JudgeParams(_Spec):
    """What a source's use of a judge may set for itself (``params:``): its own rubric, pattern and scale."""

    rubric: str | None = None
    score_pattern: str | None = None
    scale: tuple[float, float] | None = None

    _check_rubric = field_validator("rubric")(_rubric)
    _check_pattern = field_validator("score_pattern")(_score_pattern)
    _check_scale = field_validator("scale")(_scale)


class CustomGraderSpec(_Spec):
    """A custom grader: a Python function (``python: module:attr`` or ``python: path/to/file.py:attr``,
    relative to the curriculum) that runs in the grader pool, a remote HTTP grader (``url``) that gets
    one POST per /grade request with every item it applies to, or an LLM judge (``judge``) that gets one chat
    completion request per completion."""

    python: str | None = Field(default=None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    params: dict[str, Any] = Field(default_factory=dict, description="Default keyword arguments.")
    url: str | None = Field(default=None, pattern=r"^https?://")
    timeout_s: float = Field(default=30.0, gt=0, description="Remote graders: seconds per request.")
    headers: dict[str, str] = Field(default_factory=dict, description="Remote graders: extra headers.")
    judge: JudgeSpec | None = Field(default=None, description="An LLM judge behind an OpenAI-compatible endpoint.")

    @model_validator(mode="after")
    def _one_kind(self) -> CustomGraderSpec:
        if sum(kind is not None for kind in (self.python, self.url, self.judge)) != 1:
            raise ValueError("give exactly one of `python: module:attr`, `url: http://…` or `judge: {url, model, …}`")
        if self.judge is not None and (stray := sorted({"params", "timeout_s", "headers"} & self.model_fields_set)):
            raise ValueError(
                f"a judge takes its settings inside `judge:`, not {', '.join(f'`{f}`' for f in stray)} beside it"
            )
        return self


class MixEntry(_Spec):
    source: str
    weight: float = Field(default=1.0, gt=0)


class AdvanceGate(_Spec):
    """Advance to the next stage once the mean reward of this stage's last ``window`` graded completions is
    at least ``threshold`` and ``min_steps`` iterations of the stage have passed."""

    threshold: float
    window: int = Field(default=64, ge=1)
    min_steps: int = Field(default=0, ge=0)


class UniformParams(_Spec):
    pass


class UniformSamplerSpec(_Spec):
    """Each source's records in seeded epochs: every record once per epoch, in a fresh order each epoch."""

    kind: Literal["uniform"]
    params: UniformParams = Field(default_factory=UniformParams)


class _EpochParams(_Spec):
    explore: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Weight floor, as a share of the largest weight: every record stays reachable.",
    )
    epoch_mass: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="An epoch ends once the items not yet served in it hold less than this share of the total "
        "weight; no item is served twice within an epoch.",
    )
    prior: tuple[float, float] = Field(
        default=(1.0, 1.0), description="Beta prior (passes, fails) of an item never graded: 0.5 is optimistic."
    )

    @field_validator("prior")
    @classmethod
    def _positive_prior(cls, prior: tuple[float, float]) -> tuple[float, float]:
        if min(prior) <= 0:
            raise ValueError(f"both Beta prior counts must be positive, got {list(prior)}")
        return prior


class LearnabilityParams(_EpochParams):
    pass


class LearnabilitySamplerSpec(_Spec):
    """Weights each record by p̂(1 − p̂), its learnability under the pass-rate posterior."""

    kind: Literal["learnability"]
    params: LearnabilityParams = Field(default_factory=LearnabilityParams)


class SkipZeroVarianceParams(_Spec):
    min_streak: int = Field(default=1, ge=1, le=1000, description="Zero-variance groups in a row before skipping.")
    skip_probability: float = Field(default=0.5, gt=0, lt=1, description="Chance of a skip at min_streak.")
    max_skip: float = Field(
        default=0.9, gt=0, lt=1, description="Largest chance of a skip, however long the streak: items come back."
    )


class SkipZeroVarianceSamplerSpec(_Spec):
    """Seeded epochs that skip records whose latest groups all scored alike, more often the longer the streak."""

    kind: Literal["skip_zero_variance"]
    params: SkipZeroVarianceParams = Field(default_factory=SkipZeroVarianceParams)


class TargetDifficultyParams(_EpochParams):
    difficulty: Literal["pass_rate", "record", "source"] = Field(
        default="pass_rate",
        description="1 − p̂ per record, the records' own difficulty (difficulty_field), or each source's.",
    )
    initial_target: float = Field(default=0.3, ge=0, le=1, description="Target difficulty on [0, 1] at the start.")
    step: float = Field(default=0.05, gt=0, le=1, description="η: the largest move of the target per iteration.")
    sensitivity: float = Field(default=2.0, gt=0, description="α: how sharply the move follows the reward.")
    target_reward: float = Field(default=0.5, description="β: the mean reward the target is steered towards.")
    width: float = Field(default=0.1, gt=0, le=1, description="Width of the kernel around the target.")


class TargetDifficultySamplerSpec(_Spec):
    """AdaRFT: serves the records nearest a target difficulty that moves with the stage's recent reward."""

    kind: Literal["target_difficulty"]
    params: TargetDifficultyParams = Field(default_factory=TargetDifficultyParams)


SamplerSpec = Annotated[
    UniformSamplerSpec | LearnabilitySamplerSpec | SkipZeroVarianceSamplerSpec | TargetDifficultySamplerSpec,
    Field(discriminator="kind"),
]


class FixedMixingSpec(_Spec):
    """The stage's mix as written: the same source weights every iteration."""

    kind: Literal["fixed"]


class LearningProgressParams(_Spec):
    floor: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Least weight of each source the stage serves, so that none starves and each one's signal "
        "stays fresh.",
    )
    temperature: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="τ: how sharply the weights follow the sources' learning signals (lower is sharper).",
    )
    window: int = Field(
        default=64, ge=1, le=4096, description="A source's signal is the mean over its latest this many groups."
    )


class LearningProgressMixingSpec(_Spec):
    """Source weights set every iteration by what each source is teaching now: the mean |advantage| of its
    latest graded groups times what its mean reward leaves to learn, a softmax over those on top of the mix's own
    weights, and a floor per source."""

    kind: Literal["learning_progress"]
    params: LearningProgressParams = Field(default_factory=LearningProgressParams)


MixingSpec = Annotated[FixedMixingSpec | LearningProgressMixingSpec, Field(discriminator="kind")]


class ZeroVarianceRefillSpec(_Spec):
    """Replace every group whose completions all scored alike: GRPO learns nothing from it."""

    kind: Literal["zero_variance"]
    max_rounds: int = Field(default=4, ge=1, le=16, description="Refill rounds a step may ask for.")


class MeanRewardOutsideRefillSpec(_Spec):
    """Replace every group whose mean reward lies outside ``[low, high]``."""

    kind: Literal["mean_reward_outside"]
    low: float = Field(ge=0, le=1, description="Groups with a mean reward below this are replaced.")
    high: float = Field(ge=0, le=1, description="Groups with a mean reward above this are replaced.")
    max_rounds: int = Field(default=4, ge=1, le=16, description="Refill rounds a step may ask for.")

    @model_validator(mode="after")
    def _ordered(self) -> MeanRewardOutsideRefillSpec:
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g}): the kept range is [low, high]")
        return self


RefillSpec = Annotated[ZeroVarianceRefillSpec | MeanRewardOutsideRefillSpec, Field(discriminator="kind")]


class ItemStatisticsSpec(_Spec):
    decay: float = Field(
        default=0.8, gt=0, le=1, description="Each new group of a record multiplies its earlier evidence by this."
    )


class StageSpec(_Spec):
    name: str = Field(pattern=NAME_PATTERN)
    until_step: int = Field(gt=0, description="The stage ends at this iteration at the latest (exclusive).")
    mix: list[MixEntry] = Field(min_length=1)
    advance: AdvanceGate | None = None
    replay: float = Field(default=0.0, ge=0, lt=1, description="Share of each batch drawn from earlier stages.")
    sampler: SamplerSpec = Field(
        default_factory=lambda: UniformSamplerSpec(kind="uniform"),
        description="How records are chosen within each source of the mix.",
    )
    mixing: MixingSpec = Field(
        default_factory=lambda: FixedMixingSpec(kind="fixed"),
        description="How the mix's weights are set each iteration: as written, or by learning progress.",
    )
    refill: RefillSpec | None = Field(
        default=None,
        description="Which graded groups a trainer may replace (POST /refill), and in how many rounds; none by "
        "default.",
    )


class CurriculumSpec(_Spec):
    name: str = Field(pattern=NAME_PATTERN)
    seed: int = 0
    system_prompt: str | None = None
    sources: dict[str, SourceSpec] = Field(min_length=1)
    graders: dict[str, CustomGraderSpec] = Field(default_factory=dict)
    statistics: ItemStatisticsSpec = Field(default_factory=ItemStatisticsSpec)
    stages: list[StageSpec] = Field(min_length=1)

    @field_validator("sources", mode="before")
    @classmethod
    def _infer_file_kind(cls, sources: Any) -> Any:
        # `path: data/x.jsonl` is enough; `kind` is only needed when the suffix does not say it.
        if not isinstance(sources, dict):
            return sources
        out = {}
        for name, src in sources.items():
            if isinstance(src, dict) and "kind" not in src and isinstance(src.get("path"), str):
                suffix = "." + src["path"].rsplit(".", 1)[-1].lower() if "." in src["path"] else ""
                if suffix in _FILE_KINDS:
                    src = {**src, "kind": _FILE_KINDS[suffix]}
            out[name] = src
        return out

    @model_validator(mode="after")
    def _cross_references(self) -> CurriculumSpec:
        problems = _reference_problems(dict(self.sources), list(self.graders), list(self.stages))
        if problems:
            raise _Problems(problems)
        return self


def _reference_problems(
    sources: Mapping[str, SourceSpec | None] | None, graders: Sequence[str], stages: Sequence[StageSpec | None]
) -> list[tuple[str, str]]:
    """What the parts of a curriculum say of each other: names, stage order, the sources a mix names, what each
    sampler needs. A part that did not parse is ``None`` (``sources`` too, when the field itself is wrong), and
    checks that need it are left out."""
    problems: list[tuple[str, str]] = []
    for name in sources or {}:
        if not _NAME.fullmatch(name):
            problems.append((f"sources.{name}", f"source names must match {NAME_PATTERN}"))
    for name in graders:
        if not _NAME.fullmatch(name):
            problems.append((f"graders.{name}", f"grader names must match {NAME_PATTERN}"))
    seen_stage: set[str] = set()
    prev_until = 0
    last = len(stages) - 1
    for i, stage in enumerate(stages):
        if stage is None:
            continue
        where = f"stages[{i}]"
        if stage.name in seen_stage:
            problems.append((f"{where}.name", f"stage {stage.name!r} is defined twice"))
        seen_stage.add(stage.name)
        if stage.until_step <= prev_until:
            problems.append((f"{where}.until_step", f"must be greater than the previous stage's ({prev_until})"))
        prev_until = max(prev_until, stage.until_step)
        used: set[str] = set()
        for j, entry in enumerate(stage.mix):
            if sources is not None and entry.source not in sources:
                known = ", ".join(sorted(sources))
                problems.append((f"{where}.mix[{j}].source", f"unknown source {entry.source!r} (known: {known})"))
            if entry.source in used:
                problems.append((f"{where}.mix[{j}].source", f"{entry.source!r} is in this mix twice"))
            used.add(entry.source)
        if stage.replay > 0 and i == 0:
            problems.append((f"{where}.replay", "the first stage has no earlier stage to replay"))
        if stage.advance is not None and i == last:
            problems.append((f"{where}.advance", "the last stage has no next stage to advance to"))
        problems.extend(_mixing_problems(stages, i))
        if sources is not None:
            problems.extend(_sampler_problems(sources, stages, i))
    return problems


def stage_sources(stages: Sequence[StageSpec | None], i: int) -> list[str]:
    """The sources stage ``i`` serves, each once: its own mix's and, with replay, every earlier stage's (stages
    that did not parse are left out)."""
    stage = stages[i]
    assert stage is not None
    served = stages[: i + 1] if stage.replay > 0 else [stage]
    return list(dict.fromkeys(m.source for st in served if st is not None for m in st.mix))


def _mixing_problems(stages: Sequence[StageSpec | None], i: int) -> list[tuple[str, str]]:
    """A learning-progress stage's floors must fit in one batch's weights."""
    stage = stages[i]
    assert stage is not None
    if not isinstance(stage.mixing, LearningProgressMixingSpec):
        return []
    n = len(stage_sources(stages, i))
    floor = stage.mixing.params.floor
    if n * floor <= 1:
        return []
    return [
        (
            f"stages[{i}].mixing.params.floor",
            f"stage {stage.name!r} serves {n} sources, and a floor of {floor:g} each asks for {n * floor:g} of "
            f"every batch: give a floor of at most {1 / n:.4g}",
        )
    ]


def _sampler_problems(
    sources: Mapping[str, SourceSpec | None], stages: Sequence[StageSpec | None], i: int
) -> list[tuple[str, str]]:
    """An adaptive sampler chooses among a finite set of records, and needs a difficulty for each."""
    stage = stages[i]
    assert stage is not None
    sampler = stage.sampler
    if isinstance(sampler, UniformSamplerSpec):
        return []
    where = f"stages[{i}].sampler"
    problems: list[tuple[str, str]] = []
    for name in stage_sources(stages, i):
        src = sources.get(name)
        if src is None:
            continue
        if isinstance(src, ArithmeticSourceSpec) and src.size is None:
            problems.append(
                (
                    where,
                    f"{sampler.kind} chooses among a finite source's records, and sources.{name} is an endless "
                    f"generator: give it `size: N` to serve records 0..N-1",
                )
            )
        if isinstance(sampler, TargetDifficultySamplerSpec):
            mode = sampler.params.difficulty
            if mode == "record" and not (isinstance(src, FileSourceSpec) and src.difficulty_field is not None):
                problems.append(
                    (
                        f"{where}.params.difficulty",
                        f"`record` reads each record's difficulty_field, and sources.{name} has none; give it "
                        "`difficulty_field`, or use `difficulty: source` or `pass_rate`",
                    )
                )
            if mode == "source" and isinstance(src, FileSourceSpec) and src.difficulty is None:
                problems.append(
                    (
                        f"{where}.params.difficulty",
                        f"`source` reads each source's difficulty, and sources.{name} has none: give it "
                        "`difficulty: <number>`",
                    )
                )
    return problems


class _Problems(ValueError):
    """Several located problems found by one validator; unpacked by :func:`parse_spec`."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


@dataclass(frozen=True, slots=True)
class SpecParts:
    """A curriculum file read part by part: the whole ``spec`` when nothing is wrong with it; else the parts that
    parsed (for the checks that read data files and import graders) and every problem found."""

    spec: CurriculumSpec | None
    seed: int
    sources: dict[str, SourceSpec]
    graders: dict[str, CustomGraderSpec] | None  # None when one of them did not parse
    problems: list[tuple[str, str]]


def read_spec(data: Any) -> SpecParts:
    """Validate parsed YAML, reporting every problem at once, each with its YAML path."""
    if not isinstance(data, dict):
        return SpecParts(None, 0, {}, None, [("", "the file must hold a mapping (name, sources, stages, …)")])
    try:
        spec = CurriculumSpec.model_validate(data)
    except ValidationError as exc:
        # When every field parsed, the problems are those of the parts with each other, which a model validator
        # raised together (it arrives wrapped).
        located = [ctx for err in exc.errors() if isinstance(ctx := (err.get("ctx") or {}).get("error"), _Problems)]
        problems = [p for err in located for p in err.problems] or CurriculumError.from_validation(exc).problems
        return _parts(data, problems)
    return SpecParts(spec, spec.seed, dict(spec.sources), dict(spec.graders), [])


def _parts(data: dict[str, Any], problems: list[tuple[str, str]]) -> SpecParts:
    """Parse each part on its own, for the checks that read data files and import graders; where some fields did
    not parse, the checks across parts never ran: run them over the parts that did."""
    raw_sources = data.get("sources")
    known = isinstance(raw_sources, dict) and bool(raw_sources)
    raw_sources = CurriculumSpec._infer_file_kind(raw_sources) if known else {}
    sources = {str(name): _parsed(_SOURCE, raw) for name, raw in raw_sources.items()}
    raw_graders = data.get("graders")
    raw_graders = raw_graders if isinstance(raw_graders, dict) else {}
    graders = {str(name): _parsed(_CUSTOM_GRADER, raw) for name, raw in raw_graders.items()}
    raw_stages = data.get("stages")
    stages = [_parsed(_STAGE, raw) for raw in raw_stages] if isinstance(raw_stages, list) else []
    for problem in _reference_problems(sources if known else None, list(graders), stages):
        if problem not in problems:
            problems.append(problem)
    seed = data.get("seed")
    return SpecParts(
        None,
        seed if isinstance(seed, int) and not isinstance(seed, bool) else 0,
        {name: src for name, src in sources.items() if src is not None},
        None if None in graders.values() else {name: g for name, g in graders.items() if g is not None},
        problems,
    )


_SOURCE: TypeAdapter[SourceSpec] = TypeAdapter(SourceSpec)
_CUSTOM_GRADER = TypeAdapter(CustomGraderSpec)
_STAGE = TypeAdapter(StageSpec)


def _parsed(adapter: TypeAdapter[T], raw: Any) -> T | None:
    try:
        return adapter.validate_python(raw)
    except ValidationError:
        return None


def parse_spec(data: Any, *, file: str | None = None) -> CurriculumSpec:
    """Validate parsed YAML; every problem is reported at once, each with its YAML path."""
    parts = read_spec(data)
    if parts.spec is None:
        raise CurriculumError(parts.problems, file=file)
    return parts.spec
