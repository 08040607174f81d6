"""What grading one completion with one grader came to: a score, or a failure of a known kind."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FailureKind", "GraderOutcome"]


class FailureKind(enum.Enum):
    """Why a grader gave no score; each kind is counted apart in ``proctor_grader_errors``."""

    ERROR = "error"  # the grader raised, or returned something that is not a finite number
    TIMEOUT = "timeout"  # it ran past its time limit (a local grader) or its HTTP timeout (a remote one)
    CRASH = "crash"  # the process running it died
    REMOTE = "remote"  # a remote grader was unreachable, answered an error, or left the item out


@dataclass(frozen=True, slots=True)
class GraderOutcome:
    """Exactly one of ``score`` and ``failure`` is set; ``message`` says what failed and why, ``detail`` what led
    to a score (a grader that returned a :class:`~proctor.server.grading.base.Verdict`)."""

    score: float | None = None
    failure: FailureKind | None = None
    message: str = ""
    detail: Mapping[str, Any] | None = None

    @classmethod
    def scored(cls, score: float, detail: Mapping[str, Any] | None = None) -> GraderOutcome:
        return cls(score=score, detail=detail)

    @classmethod
    def failed(cls, kind: FailureKind, message: str) -> GraderOutcome:
        return cls(failure=kind, message=message)
