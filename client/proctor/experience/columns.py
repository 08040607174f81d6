"""The columns of a GRPO step's rows that proctor's own roles write and read, and the grader role.

The dataserver opens a step's table when it samples it, with the prompt's columns filled; a trainer (or
``/grade``) writes each completion; the grader role (the dataserver's pool, or ``proctor grade-worker`` processes
anywhere) reads both and writes the reward. Any other role adds columns of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from proctor.experience.consumers import Consumer

__all__ = [
    "COMPLETION",
    "COMPLETION_IDS",
    "COMPLETION_TOKENS",
    "GRADER",
    "PROMPT",
    "REFERENCE",
    "REPLACED_BY",
    "REWARD",
    "REWARD_DETAIL",
    "SAMPLE_ID",
    "STAGE",
    "STEP",
    "STEP_SLOT",
    "RewardDetail",
    "loose_table",
    "parse_reward_detail",
    "reward_detail",
]

# Written by the dataserver per slot (shared by the slot's rows) when it samples a step and opens its table.
SAMPLE_ID = "sample_id"
"""The prompt's sample id, as ``/sample`` served it in that slot."""
PROMPT = "prompt"
"""The record's prompt text."""
REFERENCE = "reference"
"""What graders compare with: ``{"answer": str | None, "metadata": {...}}`` from the record."""
STAGE = "stage"
"""The curriculum stage that served the step."""

REPLACED_BY = "replaced_by"
"""Written when a refill round (``POST /refill``) replaced the slot's group: the slot of the group that replaced
it, past the step's batch (its completions are loose completions of the step). The replaced rows stay."""

# Written per slot in a table of loose completions (a negative iteration): where each slot's completions
# belong, since its slots are not the step's.
STEP = "step"
"""The generation step the completions were graded for."""
STEP_SLOT = "step_slot"
"""The slot of that step's batch the completions answer, or -1 when the record was not served in it."""

# Written by the trainer (or ``/grade``), one per completion.
COMPLETION = "completion"
"""The completion's text."""
COMPLETION_TOKENS = "completion_tokens"
"""Its length in tokens, or null when unknown (the ``length_cap`` grader needs it)."""
COMPLETION_IDS = "completion_ids"
"""Its token ids, an int32 array (optional: kept for export and for roles that need tokens)."""

# Written by the grader role.
REWARD = "reward"
"""The completion's reward (the source's ``on_error`` reward when a grader failed)."""
REWARD_DETAIL = "reward_detail"
"""``{"components": {grader: score}, "error": str | None}``, and ``"details": {grader: {...}}`` from graders
that say what led to their score."""

GRADER = Consumer(
    "grader",
    needs=(SAMPLE_ID, PROMPT, REFERENCE, COMPLETION, COMPLETION_TOKENS),
    produces=(REWARD, REWARD_DETAIL),
)
"""The grader role, as the dataserver registers it."""


def loose_table(step: int) -> int:
    """The table that holds step ``step``'s loose completions: those that fill none of its slots (graded
    outside a training step, for a record it did not serve, or a completion other than the one its row
    holds)."""
    return -step - 1


def reward_detail(
    components: Mapping[str, float], error: str | None, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``reward_detail`` cell of a grade."""
    cell: dict[str, Any] = {"components": dict(components), "error": error}
    if details:
        cell["details"] = dict(details)
    return cell


class RewardDetail(NamedTuple):
    """What a ``reward_detail`` cell says besides the reward: each grader's score, the error that replaced
    them (None when they graded), and what the graders said of the completion."""

    components: dict[str, float]
    error: str | None
    details: dict[str, Any]


def parse_reward_detail(value: Any) -> RewardDetail:
    """A ``reward_detail`` cell's parts (empty, None and empty for anything but a cell's dict)."""
    if not isinstance(value, dict):
        return RewardDetail({}, None, {})
    components = value.get("components") or {}
    error = value.get("error")
    details = value.get("details")
    return RewardDetail(
        {str(k): float(v) for k, v in components.items()},
        None if error is None else str(error),
        {str(k): v for k, v in details.items()} if isinstance(details, dict) else {},
    )
