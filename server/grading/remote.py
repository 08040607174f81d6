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
from proctor.server.grading.registry import RemoteGrader

__all__ = ["RemoteFailure", "grade_remote"]


class RemoteFailure(str):
    """The error text of an item the remote grader gave no score for; ``timeout`` says whether it was the
    grader's time limit (counted apart in the metrics)."""

    timeout: bool

    def __new__(cls, text: str, *, timeout: bool = False) -> RemoteFailure:
        failure = super().__new__(cls, text)
        failure.timeout = timeout
        return failure


async def grade_remote(
    client: httpx.AsyncClient, grader: RemoteGrader, items: Sequence[GradeInput]
) -> list[float | RemoteFailure]:
    """Scores for ``items`` in order; an entry is the error text where the grader gave no usable score."""
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
        failure = RemoteFailure(f"remote grader {name} timed out after {grader.timeout_s:g}s", timeout=True)
    except httpx.HTTPError as exc:
        failure = RemoteFailure(f"remote grader {name} unreachable: {type(exc).__name__}: {exc}")
    else:
        if response.status_code != 200:
            failure = RemoteFailure(f"remote grader {name} answered HTTP {response.status_code}: {response.text[:200]}")
        else:
            try:
                scores = response.json()["scores"]
                if not isinstance(scores, dict):
                    raise TypeError("`scores` is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                failure = RemoteFailure(f"remote grader {name} sent no {{'scores': {{id: score}}}} object: {exc}")
    if failure is not None:  # the whole request failed: so did every item in it
        return [failure] * len(items)
    out: list[float | RemoteFailure] = []
    for i in range(len(items)):
        value = scores.get(str(i))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            out.append(
                RemoteFailure(f"remote grader {grader.key!r} returned no finite score for item {i} (got {value!r})")
            )
        else:
            out.append(float(value))
    return out
