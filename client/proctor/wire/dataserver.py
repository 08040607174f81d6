"""The wire schema of the dataserver, shared by the server and the client.

Pydantic only: the client imports this module without FastAPI. Request models validate everything that does
not depend on server settings (types, signs, shapes); limits that an operator configures (the largest
``batch_size``, the largest completion) are checked by the server and reported with the same field names.

Every integer a client sends must be a JSON integer (strict: ``"5"``, ``5.0`` and ``true`` are refused) within
a stated bound, so that a schema-valid request is also one the server can store and answer.

The API is a superset of kolibrify's RL dataserver: its trainer works against proctor unchanged.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator

__all__ = [
    "MAX_COUNT",
    "MAX_ITERATION",
    "MAX_REFILL_ROUNDS",
    "SAMPLE_ID_PATTERN",
    "CurriculumState",
    "Dashboard",
    "GradeItem",
    "GradeRequest",
    "GradeResponse",
    "GradeResult",
    "GraderErrorEntry",
    "Graders",
    "GroupStats",
    "Health",
    "IterationPoint",
    "JudgeGraderSpec",
    "LocalGraderSpec",
    "Meta",
    "MixPoint",
    "PassRateHistogram",
    "RecordStats",
    "RefillRequest",
    "RefillResponse",
    "RemoteGraderSpec",
    "Replacement",
    "Sample",
    "SampleRequest",
    "SampleResponse",
    "SourceGradersSpec",
    "SourceInfo",
    "StageInfo",
    "StageState",
    "StepStats",
    "Transition",
    "check_sample_id",
]


MAX_ITERATION = 2**53 - 1
"""The largest ``iteration``: the largest integer that every JSON parser reads exactly."""
MAX_COUNT = 2**31 - 1
"""The largest count or index on the wire (batch sizes, ranks, slots, completion indices, token counts)."""
SAMPLE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*:[0-9a-f]{10}:(0|[1-9][0-9]{0,29})$"
"""``<source>:<10 hex digits of the source's version>:<record>``, exactly as ``/sample`` serves it."""


def _valid_unicode(text: str) -> str:
    # JSON may escape a lone UTF-16 surrogate ("\ud800"); Python decodes it into a str that cannot be encoded,
    # hashed or handed to a grader as text.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone UTF-16 surrogate ({text[exc.start : exc.end]!r} at character {exc.start}), "
            "which is not valid Unicode; send the text as valid UTF-8"
        ) from None
    return text


_SAMPLE_ID = re.compile(SAMPLE_ID_PATTERN)


def check_sample_id(text: str) -> str:
    """``text`` if it has the shape of a sample id, else a ValueError that says what to send."""
    if _SAMPLE_ID.fullmatch(text) is None:
        raise ValueError(
            f"malformed sample_id {text[:80]!r}: expected '<source>:<10 hex version>:<record>' exactly as /sample "
            "returned it"
        )
    return text


Iteration = Annotated[int, Strict(), Field(ge=0, le=MAX_ITERATION)]
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Strict(), Field(gt=0, le=MAX_COUNT)]
# The pattern is checked by `check_sample_id` (for a message that says what to send) and published in the schema.
SampleIdText = Annotated[
    str,
    Strict(),
    Field(max_length=256, json_schema_extra={"pattern": SAMPLE_ID_PATTERN}),
    AfterValidator(check_sample_id),
]
Text = Annotated[str, Strict(), AfterValidator(_valid_unicode)]


class _Wire(BaseModel):
    # An answer's unknown fields are ignored, so that a client reads a newer server's answers.
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    """A request body: an unknown field is refused, since a typo (``bacth``) that was ignored would silently
    take the default. The server's answer names the known fields (``proctor.server.deps.json_body``)."""

    model_config = ConfigDict(extra="forbid")


# --- /sample -------------------------------------------------------------------------------------------


class SampleRequest(_Request):
    """Prompts for one GRPO generation step.

    ``batch_size`` is the number of distinct prompts of that step across all ranks. With ``rank`` and
    ``world_size`` the answer is that rank's contiguous share of the same batch.
    """

    # The pair is checked below; the schema says so too, so that a schema-driven client never builds one alone.
    model_config = ConfigDict(json_schema_extra={"dependentRequired": {"rank": ["world_size"], "world_size": ["rank"]}})

    iteration: Iteration = Field(description="GRPO generation step, counted from 0.")
    batch_size: Positive = Field(
        description="Distinct prompts in this step across all ranks (at most the server's max_batch_size, /meta)."
    )
    rank: Count | None = Field(default=None, description="This process's rank; needs world_size.")
    world_size: Positive | None = Field(default=None, description="Number of ranks sharing the batch.")

    @model_validator(mode="after")
    def _rank_pair(self) -> SampleRequest:
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("rank and world_size go together: send both or neither")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be below world_size {self.world_size}")
        return self


class Sample(_Wire):
    """One prompt. ``sample_id`` names the source, its content version and the record; ``slot`` is the
    prompt's place in the iteration's whole batch (a record that fills two slots is two prompts)."""

    sample_id: str
    slot: int = Field(description="Position in the iteration's batch across all ranks, from 0.")
    dataset_id: str
    system_prompt: str | None = None
    prompt: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class SampleResponse(_Wire):
    samples: list[Sample]
    stage: str
    stage_index: int
    iteration: int
    batch_size: int
    rank: int | None = None
    world_size: int | None = None
    refill_rounds: int = Field(
        default=0, description="Refill rounds this iteration's stage allows (POST /refill); 0: it refills nothing."
    )


# --- /refill -------------------------------------------------------------------------------------------

MAX_REFILL_ROUNDS = 16


class RefillRequest(_Request):
    """Which groups of a graded generation step to replace in refill round ``round``, and the prompts that
    replace them. Decided once, from the grades the server stored: every rank, retry and restart gets the same
    answer. Round 1 looks at every group of the step; each later round at the groups the round before put in."""

    iteration: Iteration = Field(description="The generation step, sampled and graded.")
    round: int = Field(strict=True, ge=1, le=MAX_REFILL_ROUNDS, description="The refill round, from 1.")
    group_size: Positive = Field(
        description="Completions per prompt (num_generations): each group the round looks at must have this many "
        "graded."
    )


class Replacement(_Wire):
    replaces: int = Field(description="The slot whose group is replaced.")
    sample: Sample = Field(description="The prompt that replaces it, in a new slot past the step's batch.")


class RefillResponse(_Wire):
    iteration: int
    round: int
    rule: str = Field(description="The stage's refill rule: zero_variance or mean_reward_outside.")
    max_rounds: int = Field(description="Refill rounds the stage allows.")
    groups: int = Field(description="Groups this round looked at.")
    replacements: list[Replacement] = Field(description="The groups replaced, in slot order; empty when none was.")


# --- /grade --------------------------------------------------------------------------------------------


class GradeItem(_Request):
    """One completion to grade. Without ``completion_index``, the items of one prompt are numbered 0, 1, 2…
    in the order they appear in the request. A prompt is its ``slot`` when given (which needs the request's
    ``iteration``); else, with the request's ``iteration``, the slot its record fills in that batch (a record
    that fills several needs its ``slot`` sent); else its ``sample_id``."""

    sample_id: SampleIdText
    completion: Text
    completion_tokens: Count | None = None
    completion_index: Count | None = None
    slot: Count | None = Field(
        default=None, description="The prompt's slot as /sample served it; tells apart two slots of one record."
    )


class GradeRequest(_Request):
    """Completions to grade. ``iteration`` attributes them to the stage of that generation step; without
    it each item is attributed to the latest iteration that served its ``sample_id``."""

    iteration: Iteration | None = None
    # fail_fast: a hostile list of a million wrong values is refused at the first, not described a million times.
    items: list[GradeItem] = Field(
        description="At most the server's max_grade_items (PROCTOR_MAX_GRADE_ITEMS).", fail_fast=True
    )

    @model_validator(mode="after")
    def _slots_need_the_iteration(self) -> GradeRequest:
        if self.iteration is None:
            for n, item in enumerate(self.items):
                if item.slot is not None:
                    raise ValueError(
                        f"items[{n}].slot is a position in one iteration's batch: send the request's iteration too"
                    )
        return self


class GradeResult(_Wire):
    """The reward of one completion. ``error`` is set when a grader raised or timed out, or when the
    sample's source changed since it was served; ``reward`` is then the source's ``on_error`` value."""

    sample_id: str
    completion_index: int
    slot: int | None = None
    reward: float
    components: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    details: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="What led to a grader's score, by grader key, from the graders that say (the `code` grader: "
        "each test's verdict and why the run failed).",
    )
    cached: bool = Field(default=False, description="True when this exact completion was graded before.")
    table: int | None = Field(
        default=None,
        description="The experience-store table that holds the completion (GET /experience/tables/{table}): its step, "
        "or -(step + 1) for the step's loose completions (graded outside the step's batch, or another completion "
        "than the one its row holds). Null for a completion answered from its stored grade, or not graded.",
    )


class GradeResponse(_Wire):
    results: list[GradeResult]


# --- /graders (what a grade-worker runs) -------------------------------------------------------------------


class LocalGraderSpec(_Wire):
    key: str
    ref: str = Field(description="builtin:NAME, module:attr or /abs/file.py:attr; importable where it runs.")
    params: dict[str, Any]
    weight: float
    multiplicative: bool


class RemoteGraderSpec(_Wire):
    key: str
    url: str
    timeout_s: float
    headers: dict[str, str] = Field(description="Values are withheld (empty) unless the server has an API key.")
    params: dict[str, Any]
    weight: float
    multiplicative: bool


class JudgeGraderSpec(_Wire):
    """An LLM judge behind an OpenAI-compatible endpoint, as a source uses it; its API key is never sent: a
    grade-worker uses its own PROCTOR_JUDGE_API_KEY."""

    key: str
    name: str = Field(description="The judge's name under the curriculum's `graders`; its users share its cap.")
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


class SourceGradersSpec(_Wire):
    local: list[LocalGraderSpec]
    remote: list[RemoteGraderSpec]
    on_error: float
    names: list[str] = Field(description="Every grader's key, in the curriculum's order.")
    judges: list[JudgeGraderSpec] = Field(default_factory=list, description="The source's LLM judges.")


class Graders(_Wire):
    """Each source's graders, as the dataserver resolved them: what ``proctor grade-worker`` runs."""

    curriculum_hash: str
    timeout_s: float = Field(description="Time limit to grade one completion (PROCTOR_GRADER_TIMEOUT_S).")
    headers_withheld: bool = Field(
        description="True when remote graders' header values were left out: this server has no API key."
    )
    sources: dict[str, SourceGradersSpec]


# --- /meta, /curriculum, /healthz ------------------------------------------------------------------------


class StageInfo(_Wire):
    name: str
    until_step: int


class SourceInfo(_Wire):
    name: str
    kind: str
    version: str
    size: int | None = Field(description="Records in the source; null for procedural generators.")
    graders: list[str]


class Meta(_Wire):
    total_iterations: int
    stages: list[StageInfo]
    curriculum: str
    curriculum_hash: str
    seed: int
    run: str = Field(description="The run whose state this server keeps (`proctor serve --run`).")
    sources: list[SourceInfo]
    max_batch_size: int
    max_grade_items: int = Field(description="Most items one /grade request may carry.")
    max_body_bytes: int = Field(description="Largest request body; ProctorClient splits a /grade to fit.")
    version: str


class Transition(_Wire):
    iteration: int = Field(description="First iteration served by the new stage.")
    from_stage: str
    to_stage: str
    reason: str
    rolling_reward: float | None = None
    rolling_count: int | None = None


class MixPoint(_Wire):
    """The source weights one iteration was served with."""

    iteration: int
    weights: dict[str, float]


class StageState(_Wire):
    name: str
    index: int
    until_step: int
    started_at: int | None = Field(description="Iteration at which the stage began; null if not reached.")
    advance: dict[str, float | int] | None = None
    refill: dict[str, str | float | int] | None = Field(
        default=None, description="The stage's refill rule (POST /refill), as written; null when it refills nothing."
    )
    iterations: int = Field(description="Iterations sampled in this stage.")
    samples: int = Field(description="Prompts served in this stage.")
    graded: int = Field(description="Completions graded without error.")
    errors: int = Field(description="Completions whose grading failed.")
    mean_reward: float | None = None
    rolling_reward: float | None = Field(description="Mean of the gate's window of latest grades.")
    rolling_count: int
    sampler: str = Field(default="uniform", description="How the stage chooses records within each source.")
    mixing: str = Field(
        default="fixed", description="How the stage sets its source weights: fixed or learning_progress."
    )
    mix_weights: dict[str, float] | None = Field(
        default=None, description="learning_progress: the source weights the stage's next new iteration would get."
    )
    learning_signals: dict[str, float | None] | None = Field(
        default=None,
        description="learning_progress: each source's mean |advantage| over its latest graded groups (null: none yet).",
    )
    mix_history: list[MixPoint] | None = Field(
        default=None,
        description="learning_progress: the source weights of the stage's latest iterations, oldest first.",
    )


class CurriculumState(_Wire):
    curriculum: str
    curriculum_hash: str
    current_stage: str
    current_stage_index: int
    last_iteration: int | None = Field(description="Highest iteration sampled so far.")
    total_iterations: int
    transitions: list[Transition]
    stages: list[StageState]


class IterationPoint(_Wire):
    """One sampled iteration as its grades came in."""

    iteration: int
    stage: str
    stage_index: int
    graded: int = Field(description="Completions graded without error.")
    errors: int = Field(description="Completions whose grading failed.")
    mean_reward: float | None = Field(description="Mean reward of the completions graded without error.")
    groups: int = Field(description="Groups (one prompt's completions) with at least two graded completions.")
    zero_variance_groups: int = Field(description="Of those, groups whose completions all got the same reward.")
    mix_weights: dict[str, float] | None = Field(
        default=None, description="The source weights a learning_progress stage served the iteration with."
    )
    refill_rounds: int = Field(default=0, description="Refill rounds (POST /refill) that replaced groups.")
    refilled_groups: int = Field(default=0, description="Groups those rounds replaced.")


class PassRateHistogram(_Wire):
    """A source's records by the posterior mean of their pass rate (records with a graded group only)."""

    source: str
    records: int | None = Field(description="Records in the source; null for an endless generator (not tracked).")
    graded_records: int
    bins: list[int] = Field(description="Counts over 10 equal bins of [0, 1]: [0, 0.1), …, [0.9, 1].")
    mean_pass_rate: float | None


class GraderErrorEntry(_Wire):
    iteration: int
    sample_id: str
    error: str


class Dashboard(_Wire):
    """Everything the live page at ``GET /`` draws, in one answer."""

    curriculum: str
    current_stage: str
    last_iteration: int | None
    total_iterations: int
    stages: list[StageState]
    transitions: list[Transition]
    iterations: list[IterationPoint] = Field(description="The latest sampled iterations (at most 2048), oldest first.")
    pass_rates: list[PassRateHistogram]
    grader_errors: int = Field(description="Completions whose grading failed, over the whole run.")
    recent_errors: list[GraderErrorEntry] = Field(description="The latest grader errors (at most 20), newest first.")


class GroupStats(_Wire):
    """One prompt's completions in a step (a GRPO group): their grades, as the curriculum counts them."""

    slot: int | None = Field(description="Its slot in the step's batch; null for completions graded outside it.")
    sample_id: str
    graded: int = Field(description="Completions graded without error (every attempt at the step's rows).")
    mean_reward: float
    reward_std: float = Field(description="Population standard deviation of the rewards.")


class RecordStats(_Wire):
    """A record's history as the adaptive samplers read it (sources they track: files, not generators)."""

    sample_id: str
    passes: float = Field(description="Graded completions at or above the source's pass threshold (decayed).")
    fails: float = Field(description="Graded completions below it (decayed).")
    groups: int = Field(description="Groups of the record graded so far.")
    streak: int = Field(description="Consecutive groups, newest first, in which every completion passed.")
    last_iteration: int | None = Field(description="The step of its newest graded group.")


class StepStats(_Wire):
    """``GET /stats/{iteration}``: a step's groups and their records; they join ``proctor export``'s rows on
    ``(iteration, slot)`` and ``sample_id``."""

    iteration: int
    stage: str
    groups: list[GroupStats] = Field(description="By slot, then sample_id; at most the server's row limit.")
    truncated: bool = Field(description="Whether more groups exist than were returned.")
    records: list[RecordStats] = Field(description="The groups' records, for the sources the samplers track.")


class Health(_Wire):
    status: str
    curriculum: str
    last_iteration: int | None
