"""The grader fanout: the built-in verdicts it reaches in the server's own process (plain numbers, exact
matches) are the grader processes' verdicts, and everything else still goes to a grader process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import httpx
import pytest

from proctor.server.grading.base import GradeInput
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.outcome import GraderOutcome
from proctor.server.grading.pool import GraderPool, GraderPoolError
from proctor.server.grading.registry import LocalGrader, SourceGraders
from proctor.server.metrics import Metrics

pytestmark = pytest.mark.anyio

MATH = LocalGrader("math", "builtin:math", {}, 1.0, False)
EXACT = LocalGrader("exact_match", "builtin:exact_match", {}, 1.0, False)
CASED = LocalGrader("exact_match", "builtin:exact_match", {"case_sensitive": True}, 1.0, False)
NO_TIME = LocalGrader("math", "builtin:math", {"timeout_s": 0}, 1.0, False)
UNKNOWN = LocalGrader("math", "builtin:math", {"digits": 3}, 1.0, False)
NUMERIC = LocalGrader("numeric", "builtin:numeric", {}, 1.0, False)
LOOSE = LocalGrader("numeric", "builtin:numeric", {"rel_tol": 0.1}, 1.0, False)
BAD_TOL = LocalGrader("numeric", "builtin:numeric", {"rel_tol": "tight"}, 1.0, False)
NUMERIC_UNKNOWN = LocalGrader("numeric", "builtin:numeric", {"digits": 3}, 1.0, False)

# (reference, completion): plain numbers both ways, forms only math-verify reads, text, and hostile ones.
CASES = [
    ("42", "42"),
    ("42", "41"),
    ("42", "<think>6 times 7</think>42"),
    ("3/4", "0.75"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("1,234", "1234"),
    ("5", "$5$"),
    ("5", "5.0000000000000000001"),
    ("5", "5.4"),
    ("1e3", "the answer is \\boxed{1,000}"),
    ("12", "\\boxed{" + "{" * 30_000),
    ("2", "2 apples"),
    ("x^2", "x^2"),
    ("Paris", "paris"),
    ("Paris", " Paris "),
    ("7", "9" * 5000),
    ("7", "\\(" + "1" * 50_000),
    (None, "5"),
]


@pytest.fixture
async def pool() -> AsyncIterator[GraderPool]:
    p = GraderPool(1)
    await p.start()
    yield p
    await p.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def work(graders: Sequence[LocalGrader]) -> list[tuple[SourceGraders, GradeInput]]:
    source = SourceGraders(tuple(graders), (), 0.0)
    return [(source, GradeInput(prompt="p", completion=c, answer=a)) for a, c in CASES]


@pytest.mark.parametrize(
    "graders",
    [
        [MATH],
        [EXACT],
        [CASED],
        [MATH, EXACT],
        [NO_TIME],
        [UNKNOWN],
        [NUMERIC],
        [LOOSE],
        [BAD_TOL],
        [NUMERIC_UNKNOWN],
        [NUMERIC, MATH],
    ],
    ids=[
        "math",
        "exact_match",
        "case_sensitive",
        "both",
        "bad-param",
        "unknown-param",
        "numeric",
        "numeric-rel_tol",
        "numeric-bad-param",
        "numeric-unknown-param",
        "numeric-and-math",
    ],
)
async def test_every_verdict_is_the_grader_processes(
    pool: GraderPool, http: httpx.AsyncClient, graders: list[LocalGrader]
) -> None:
    items = work(graders)
    here = await GraderFanout(pool, http, Metrics(), 10.0).grade(items)
    there = await pool.run_many([(g.local, sample) for g, sample in items], 10.0)
    # The fanout names the grader in a failure's message; the pool's outcomes do not.
    named = [
        {k: o if o.failure is None else GraderOutcome.failed(o.failure, f"{k}: {o.message}") for k, o in t.items()}
        for t in there
    ]
    assert here == named


async def test_plain_numbers_are_graded_without_a_grader_process(pool: GraderPool, http: httpx.AsyncClient) -> None:
    await pool.close()  # a grader process would now be refused
    fanout = GraderFanout(pool, http, Metrics(), 10.0)
    source = SourceGraders((MATH, EXACT, NUMERIC), (), 0.0)
    assert await fanout.grade([(source, GradeInput(prompt="p", completion="<think>…</think>12", answer="12"))]) == [
        {
            "math": GraderOutcome.scored(1.0),
            "exact_match": GraderOutcome.scored(1.0),
            "numeric": GraderOutcome.scored(1.0),
        }
    ]
    with pytest.raises(GraderPoolError, match="shut down"):
        await fanout.grade([(source, GradeInput(prompt="p", completion="x^2", answer="x^2"))])
    # numeric walks a completion character by character: a long one is left to a grader process.
    numeric = SourceGraders((NUMERIC,), (), 0.0)
    with pytest.raises(GraderPoolError, match="shut down"):
        await fanout.grade([(numeric, GradeInput(prompt="p", completion="1" * 20_001, answer="12"))])
