"""The wire schema of the dataserver, shared by the server and the client.

Pydantic only: the client imports this module without FastAPI. Request models validate everything that does
not depend on server settings (types, signs, shapes); limits that an operator configures (the largest
``batch_size``, the largest completion) are checked by the server and reported with the same field names.

The API is a superset of kolibrify's RL dataserver: its trainer works against proctor unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CurriculumState",
    "GradeItem",
    "GradeRequest",
    "GradeResponse",
    "GradeResult",
    "Health",
    "Meta",
    "Sample",
    "SampleRequest",
    "SampleResponse",
    "SourceInfo",
    "StageInfo",
    "StageState",
    "Transition",
]


class _Wire(BaseModel):
    # Unknown fields are ignored rather than refused so that newer clients can talk to older servers.
    model_config = ConfigDict(extra="ignore")


# --- /sample -------------------------------------------------------------------------------------------


class SampleRequest(_Wire):
    """Prompts for one GRPO generation step.

    ``batch_size`` is the number of distinct prompts of that step across all ranks. With ``rank`` and
    ``world_size`` the answer is that rank's contiguous share of the same batch.
    """

    iteration: int = Field(ge=0, description="GRPO generation step, counted from 0.")
    batch_size: int = Field(gt=0, description="Distinct prompts in this step across all ranks.")
    rank: int | None = Field(default=None, ge=0, description="This process's rank; needs world_size.")
    world_size: int | None = Field(default=None, gt=0, description="Number of ranks sharing the batch.")

    @model_validator(mode="after")
    def _rank_pair(self) -> SampleRequest:
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("rank and world_size go together: send both or neither")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be below world_size {self.world_size}")
        return self


class Sample(_Wire):
    """One prompt. ``sample_id`` names the source, its content version and the record."""

    sample_id: str
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


# --- /grade --------------------------------------------------------------------------------------------


class GradeItem(_Wire):
    """One completion to grade. Without ``completion_index``, the items of one ``sample_id`` are numbered
    0, 1, 2… in the order they appear in the request."""

    sample_id: str = Field(min_length=1)
    completion: str
    completion_tokens: int | None = Field(default=None, ge=0)
    completion_index: int | None = Field(default=None, ge=0)


class GradeRequest(_Wire):
    """Completions to grade. ``iteration`` attributes them to the stage of that generation step; without
    it each item is attributed to the latest iteration that served its ``sample_id``."""

    iteration: int | None = Field(default=None, ge=0)
    items: list[GradeItem]


class GradeResult(_Wire):
    """The reward of one completion. ``error`` is set when a grader raised or timed out, or when the
    sample's source changed since it was served; ``reward`` is then the source's ``on_error`` value."""

    sample_id: str
    completion_index: int
    reward: float
    components: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    cached: bool = Field(default=False, description="True when this exact completion was graded before.")


class GradeResponse(_Wire):
    results: list[GradeResult]


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
    sources: list[SourceInfo]
    max_batch_size: int
    version: str


class Transition(_Wire):
    iteration: int = Field(description="First iteration served by the new stage.")
    from_stage: str
    to_stage: str
    reason: str
    rolling_reward: float | None = None
    rolling_count: int | None = None


class StageState(_Wire):
    name: str
    index: int
    until_step: int
    started_at: int | None = Field(description="Iteration at which the stage began; null if not reached.")
    advance: dict[str, float | int] | None = None
    iterations: int = Field(description="Iterations sampled in this stage.")
    samples: int = Field(description="Prompts served in this stage.")
    graded: int = Field(description="Completions graded without error.")
    errors: int = Field(description="Completions whose grading failed.")
    mean_reward: float | None = None
    rolling_reward: float | None = Field(description="Mean of the gate's window of latest grades.")
    rolling_count: int


class CurriculumState(_Wire):
    curriculum: str
    curriculum_hash: str
    current_stage: str
    current_stage_index: int
    last_iteration: int | None = Field(description="Highest iteration sampled so far.")
    total_iterations: int
    transitions: list[Transition]
    stages: list[StageState]


class Health(_Wire):
    status: str
    curriculum: str
    last_iteration: int | None
