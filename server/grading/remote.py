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

__all__ = ["grade_remote"]


async def grade_remote(
    client: httpx.AsyncClient, grader: RemoteGrader, items: Sequence[GradeInput]
) -> list[float | str]:
    """Scores for ``items`` in order; an entry is the error text where the grader gave no usable score."""
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
    try:
        response = await client.post(grader.url, json=payload, headers=dict(grader.headers), timeout=grader.timeout_s)
    except httpx.TimeoutException:
        return [f"remote grader {grader.key!r} timed out after {grader.timeout_s:g}s"] * len(items)
    except httpx.HTTPError as exc:
        return [f"remote grader {grader.key!r} unreachable: {type(exc).__name__}: {exc}"] * len(items)
    if response.status_code != 200:
        return [f"remote grader {grader.key!r} answered HTTP {response.status_code}: {response.text[:200]}"] * len(
            items
        )
    try:
        scores = response.json()["scores"]
        if not isinstance(scores, dict):
            raise TypeError("`scores` is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        return [f"remote grader {grader.key!r} sent no {{'scores': {{id: score}}}} object: {exc}"] * len(items)
    out: list[float | str] = []
    for i in range(len(items)):
        value = scores.get(str(i))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            out.append(f"remote grader {grader.key!r} returned no finite score for item {i} (got {value!r})")
        else:
            out.append(float(value))
    return out
