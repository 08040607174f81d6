"""The reward-server protocols of other trainers, as the dataserver serves them, and its own ``/score`` that they
map onto: a completion and a label that names the record it answers (a sample id), or, for a label that names
none, the reference answer a configured default source's graders compare with.

- OpenRLHF (``--reward.remote_url``, ``openrlhf/utils/agent.py``'s ``_fetch_rewards_via_http``) posts
  ``{query, prompts, labels}``, the query being the prompt and response decoded together, and reads
  ``rewards``, ``scores`` and ``extra_logs``;
- slime (``--rm-type remote_rm --rm-url``, ``slime/rollout/rm_hub/__init__.py``'s ``remote_rm``) posts one
  ``{prompt, response, label}`` and reads the reward, a bare number.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from proctor.wire.dataserver import Text, _Request, _Wire

__all__ = [
    "OpenRLHFRewardRequest",
    "OpenRLHFRewardResponse",
    "ScoreItem",
    "ScoreRequest",
    "ScoreResponse",
    "ScoreResult",
    "SlimeRewardRequest",
]

Label = Annotated[str, Field(max_length=4096)]
# A peer's dataset may hold a label as a JSON number (an answer, say); it is read as its text.
PeerLabel = Label | int | float


class ScoreItem(_Request):
    response: Text = Field(description="The completion: the model's answer, without the prompt.")
    label: Label | None = Field(
        default=None,
        description="A sample id (the record the completion answers, graded by its source's graders), or else "
        "the reference answer for the default source's graders (PROCTOR_PEER_DEFAULT_SOURCE).",
    )
    prompt: Text | None = Field(default=None, description="The prompt, for graders that read it (unlabelled).")


class ScoreRequest(_Request):
    """Rewards for completions named by label rather than by a served step and slot."""

    items: list[ScoreItem] = Field(
        min_length=1, description="At most the server's max_grade_items (/meta) completions."
    )


class ScoreResult(_Wire):
    reward: float
    components: dict[str, float] = Field(default_factory=dict, description="Each grader's score.")
    error: str | None = Field(default=None, description="Why grading failed; the reward is then on_error's.")
    sample_id: str | None = Field(description="The record graded against; null for the default source.")


class ScoreResponse(_Wire):
    results: list[ScoreResult]


class OpenRLHFRewardRequest(_Wire):
    """OpenRLHF's remote reward-model request. Its unknown fields are ignored, as a reward server of its own
    would ignore them."""

    query: list[Text] = Field(min_length=1, description="Each prompt and response, decoded together.")
    prompts: list[Text] | None = Field(default=None, description="Each prompt, as the query starts with it.")
    labels: list[PeerLabel | None] | None = Field(default=None, description="Each sample's label.")

    @model_validator(mode="after")
    def _lengths(self) -> OpenRLHFRewardRequest:
        for name in ("prompts", "labels"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.query):
                raise ValueError(
                    f"{name} has {len(values)} entries and query {len(self.query)}: send one per query, in order"
                )
        return self


class OpenRLHFRewardResponse(_Wire):
    rewards: list[float] = Field(description="What OpenRLHF's advantages are computed from.")
    scores: list[float] = Field(description="What its dynamic filtering reads: the same rewards.")
    extra_logs: dict[str, list[float]] = Field(
        description="Logged by OpenRLHF: each grader's score where every query has one, and grading_errors (0 or 1)."
    )


class SlimeRewardRequest(_Wire):
    """slime's ``remote_rm`` request. Its unknown fields are ignored."""

    prompt: Text | list[dict[str, Any]] | None = Field(default=None, description="Text, or chat messages.")
    response: Text
    label: PeerLabel | None = None
