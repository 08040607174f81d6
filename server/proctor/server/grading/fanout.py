"""Sends completions to every grader of their source at once: the local graders in the process pool (or, for
the built-in verdicts that are cheap and bounded, here), each remote grader in one HTTP request per
``/grade`` request, and each LLM judge in one request per completion (within the judge's cap), side by side."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx
from pydantic import SecretStr

from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import FAST_VERDICTS
from proctor.server.grading.judge import JudgeClient
from proctor.server.grading.outcome import GraderOutcome
from proctor.server.grading.pool import GraderPool, Task
from proctor.server.grading.registry import BUILTIN_PREFIX, JudgeGrader, LocalGrader, RemoteGrader, SourceGraders
from proctor.server.grading.remote import grade_remote
from proctor.server.metrics import Metrics
from proctor.server.pacing import paced

__all__ = ["GraderFanout"]


class GraderFanout:
    def __init__(
        self,
        pool: GraderPool,
        http: httpx.AsyncClient,
        metrics: Metrics,
        timeout_s: float,
        *,
        judge_api_key: SecretStr | None = None,
    ) -> None:
        self.pool = pool
        self.http = http
        self.metrics = metrics
        self.timeout_s = timeout_s
        # Lives as long as the fanout: each judge's cap holds across every /grade at once.
        self.judges = JudgeClient(judge_api_key)

    async def aclose(self) -> None:
        """Close the judges' connections (the pool and ``http`` are the caller's)."""
        await self.judges.aclose()

    async def grade(self, work: Sequence[tuple[SourceGraders, GradeInput]]) -> list[dict[str, GraderOutcome]]:
        """Every grader's outcome for each completion, by grader key, in the order of ``work``."""
        outcomes: list[dict[str, GraderOutcome]] = [{} for _ in work]
        jobs = [self._local(work, outcomes)]
        by_source: dict[int, list[int]] = {}
        for n, (graders, _) in enumerate(work):
            if graders.remote or graders.judges:
                by_source.setdefault(id(graders), []).append(n)
        for indexes in by_source.values():
            for grader in work[indexes[0]][0].remote:
                jobs.append(self._remote(grader, work, indexes, outcomes))
            for judge in work[indexes[0]][0].judges:
                jobs.append(self._judge(judge, work, indexes, outcomes))
        await asyncio.gather(*jobs)
        for per_item in outcomes:
            for key, o in per_item.items():
                if o.failure is not None:
                    self.metrics.grader_errors.labels(key, o.failure.value).inc()
        return outcomes

    async def _local(
        self, work: Sequence[tuple[SourceGraders, GradeInput]], outcomes: list[dict[str, GraderOutcome]]
    ) -> None:
        # A completion whose local graders all reach a verdict here (plain numbers, exact matches) skips the
        # round trip to a grader process; the rest go there, with their time limits.
        indexes = []
        async for n in paced([n for n, (graders, _) in enumerate(work) if graders.local]):
            graders, sample = work[n]
            fast = _fast_outcomes(graders.local, sample)
            if fast is None:
                indexes.append(n)
            else:
                outcomes[n].update(fast)
        if not indexes:
            return
        tasks: list[Task] = [(work[n][0].local, work[n][1]) for n in indexes]
        started = time.perf_counter()
        results = await self.pool.run_many(tasks, self.timeout_s)
        self.metrics.grader_seconds.observe(time.perf_counter() - started)
        for n, result in zip(indexes, results, strict=True):
            for key, o in result.items():
                # The pool's messages do not say which grader they are about; the reward's error must.
                outcomes[n][key] = o if o.failure is None else GraderOutcome.failed(o.failure, f"{key}: {o.message}")

    async def _remote(
        self,
        grader: RemoteGrader,
        work: Sequence[tuple[SourceGraders, GradeInput]],
        indexes: list[int],
        outcomes: list[dict[str, GraderOutcome]],
    ) -> None:
        results = await grade_remote(self.http, grader, [work[n][1] for n in indexes])
        for n, o in zip(indexes, results, strict=True):
            outcomes[n][grader.key] = o

    async def _judge(
        self,
        judge: JudgeGrader,
        work: Sequence[tuple[SourceGraders, GradeInput]],
        indexes: list[int],
        outcomes: list[dict[str, GraderOutcome]],
    ) -> None:
        results = await self.judges.grade(judge, [work[n][1] for n in indexes])
        for n, o in zip(indexes, results, strict=True):
            outcomes[n][judge.key] = o


def _fast_outcomes(graders: Sequence[LocalGrader], sample: GradeInput) -> dict[str, GraderOutcome] | None:
    """Every grader's outcome reached in this process (:data:`~proctor.server.grading.builtin.FAST_VERDICTS`),
    or None when any of them needs a grader process."""
    out: dict[str, GraderOutcome] = {}
    for g in graders:
        fast = FAST_VERDICTS.get(g.ref.removeprefix(BUILTIN_PREFIX)) if g.ref.startswith(BUILTIN_PREFIX) else None
        if fast is None:
            return None
        try:
            score = fast(sample, **g.params)
        except (TypeError, ValueError, ArithmeticError):
            return None  # a bad parameter or an unreadable number: the grader process says what is wrong
        if score is None:
            return None
        out[g.key] = GraderOutcome.scored(score)
    return out
