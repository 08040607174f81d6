"""Remote HTTP graders: one POST per /grade request carrying every completion the grader applies to.

Request::

    POST <url>
    {"params": {...}, "items": [{"id": "0", "prompt": …, "answer": …, "metadata": {…},
                                 "completion": …, "completion_tokens": …}, …]}

Response: ``{"scores": {"0": 1.0, …}}``. Scores are matched by ``id``, never by position: an item whose id
is missing from the answer gets an error result, not somebody else's score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx

from proctor.server.grading.base import GradeInput
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.registry import RemoteGrader

__all__ = ["grade_remote"]


async def grade_remote(
    client: httpx.AsyncClient, grader: RemoteGrader, items: Sequence[GradeInput]
) -> list[GraderOutcome]:
    """The grader's outcome for each of ``items``, in order: a score, or why it gave none."""
    name = repr(grader.key)
    payload = {
        "params": dict(grader.params),
        "items": [
            {
                "id": str(i),
                "prompt": s.prompt,
                "answer": s.answer,
                "metadata": dict(s.metadata),
                "completion": s.completion,
                "completion_tokens": s.completion_tokens,
            }
            for i, s in enumerate(items)
        ],
    }
    failure = None
    try:
        response = await client.post(grader.url, json=payload, headers=dict(grader.headers), timeout=grader.timeout_s)
    except httpx.TimeoutException:
        failure = GraderOutcome.failed(
            FailureKind.TIMEOUT, f"remote grader {name} timed out after {grader.timeout_s:g}s"
        )
    except httpx.HTTPError as exc:
        failure = GraderOutcome.failed(
            FailureKind.REMOTE, f"remote grader {name} unreachable: {type(exc).__name__}: {exc}"
        )
    else:
        if response.status_code != 200:
            failure = GraderOutcome.failed(
                FailureKind.REMOTE, f"remote grader {name} answered HTTP {response.status_code}: {response.text[:200]}"
            )
        else:
            try:
                scores = response.json()["scores"]
                if not isinstance(scores, dict):
                    raise TypeError("`scores` is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                failure = GraderOutcome.failed(
                    FailureKind.REMOTE, f"remote grader {name} sent no {{'scores': {{id: score}}}} object: {exc}"
                )
    if failure is not None:  # the whole request failed: so did every item in it
        return [failure] * len(items)
    out: list[GraderOutcome] = []
    for i in range(len(items)):
        value = scores.get(str(i))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            message = f"remote grader {name} returned no finite score for item {i} (got {value!r})"
            out.append(GraderOutcome.failed(FailureKind.REMOTE, message))
        else:
            out.append(GraderOutcome.scored(float(value)))
    return out
