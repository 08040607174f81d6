"""What a grader sees and how it is called.

A grader is a plain function ``fn(sample: GradeInput, **params) -> float``, or ``-> Verdict`` when it has more to
say than a number (the tests a program passed, why it failed). Built-in graders live in
:mod:`proctor.server.grading.builtin`; custom ones are referenced from a curriculum as ``module:attr`` or
``path/to/file.py:attr`` and have the same shape. A grader that cannot score a completion raises: the pool
turns the exception into an error result with the source's ``on_error`` reward, it never becomes a silent 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GradeInput", "GraderFn", "Verdict", "split_think"]

_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A score with what led to it: ``detail`` is a JSON object, answered in ``/grade``'s ``details`` under the
    grader's key and kept with the grade."""

    score: float
    detail: Mapping[str, Any]


# ``fn(sample, **params) -> float | Verdict``. Callable[..., ...] rather than a Protocol: a Protocol with
# ``**params: Any`` would reject every grader that names its keyword-only parameters.
GraderFn = Callable[..., "float | Verdict"]


@dataclass(frozen=True, slots=True)
class GradeInput:
    """One completion with the record it answers, as a grader receives it.

    ``answer`` is the record's reference answer (``None`` when the source has none); ``metadata`` the
    record's extra fields. ``completion_tokens`` is what the trainer reported, if it did.
    """

    prompt: str
    completion: str
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    completion_tokens: int | None = None

    @property
    def response(self) -> str:
        """The final answer part of the completion: the text after a leading ``<think>…</think>`` block."""
        return split_think(self.completion)[1]


def split_think(completion: str) -> tuple[str | None, str]:
    """Split ``<think>reasoning</think>answer`` into ``(reasoning, answer)``; no block gives ``(None, text)``.

    Answer graders look only at the answer part, so reasoning that mentions a wrong number along the way
    does not change the score.
    """
    m = _THINK.match(completion)
    if m is None:
        return None, completion
    return m.group(1), completion[m.end() :]
