"""LLM judges: a model behind any OpenAI-compatible endpoint scores each completion against a rubric.

Each completion is one request::

    POST <url>/chat/completions
    Authorization: Bearer <PROCTOR_JUDGE_API_KEY>          (when the setting is given)
    {"model": …, "messages": [{"role": "user", "content": <the rubric, filled in>}],
     "max_tokens": …, "temperature": …}

and its score is the last match of the judge's ``score_pattern`` in ``choices[0].message.content`` (after a
leading ``<think>…</think>`` block), scaled from the judge's ``scale`` to 0..1.

A judge's ``max_concurrency`` caps the requests in flight to it across every ``/grade`` of the server at once:
the caps live in one :class:`JudgeClient`, which the server's grader fanout holds for its whole life. Each of a
judge's slots keeps a connection of its own, so that what a request costs here does not grow with the cap. A request
that gets a 429, a 5xx or no connection is tried again, up to ``retries`` times, after an exponential backoff with
jitter (or the ``Retry-After`` the judge sent, bounded); any other 4xx is a failure at once. One request may take
``timeout_s``; a completion waits at most ``deadline_s`` for its verdict, the wait for a free slot and the retries
included, so a judge that hangs gives ``timeout`` verdicts, never a ``/grade`` that hangs with it.

The API key goes into the request's header and nowhere else: not into a message, a log line or a repr, and any
text of the judge's that a verdict quotes has it blotted out.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import math
import random
import re
import ssl
import string
import time
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from pydantic import SecretStr

from proctor.server.exceptions import ProctorError
from proctor.server.grading.base import GradeInput, split_think
from proctor.server.grading.handoff import HandOff
from proctor.server.grading.outcome import FailureKind, GraderOutcome
from proctor.server.grading.registry import JudgeGrader

__all__ = ["JudgeClient", "MissingAnswer", "read_score", "render_rubric"]

log = logging.getLogger("proctor.judge")

QUOTED_CHARS = 200  # how much of a judge's text a verdict quotes


class MissingAnswer(ProctorError, ValueError):
    """The rubric names ``{answer}`` and the record has no reference answer."""


@functools.lru_cache(maxsize=256)
def _placeholders(template: str) -> frozenset[str]:
    return frozenset(f for _, f, _, _ in string.Formatter().parse(template) if f is not None)


def render_rubric(template: str, sample: GradeInput) -> str:
    """The judge's prompt: ``template`` with ``{prompt}``, ``{completion}``, ``{response}`` and ``{answer}`` filled
    in (the curriculum's loader has refused any other placeholder). Raises :class:`MissingAnswer` when it names
    ``{answer}`` and the record has none."""
    if sample.answer is None and "answer" in _placeholders(template):
        raise MissingAnswer
    return template.format_map(
        {"prompt": sample.prompt, "completion": sample.completion, "response": sample.response, "answer": sample.answer}
    )


def read_score(judge: JudgeGrader, text: str) -> GraderOutcome:
    """The score in a judge's answer, scaled to 0..1, with the score and the answer's start as its detail; or, when
    it holds none, a failure that quotes it."""
    name = repr(judge.key)
    answer = split_think(text)[1]  # a reasoning judge's thoughts are not its verdict
    matches = list(re.finditer(judge.score_pattern, answer))
    if not matches:
        quoted = answer.strip()[:QUOTED_CHARS]
        return GraderOutcome.failed(FailureKind.ERROR, f"judge {name}: no score in its answer: {quoted!r}")
    raw = matches[-1].group(1)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        return GraderOutcome.failed(FailureKind.ERROR, f"judge {name}: its score {raw!r} is not a number")
    lo, hi = judge.scale
    if not lo <= value <= hi:
        return GraderOutcome.failed(
            FailureKind.ERROR, f"judge {name}: its score {value:g} is outside its scale [{lo:g}, {hi:g}]"
        )
    # The detail says what the judge said: its score on its own scale, and the start of its answer.
    return GraderOutcome.scored((value - lo) / (hi - lo), {"score": value, "answer": answer.strip()[:QUOTED_CHARS]})


class _Verdict(Exception):
    """A completion's grading ended without a score; ``outcome`` says why."""

    def __init__(self, outcome: GraderOutcome) -> None:
        self.outcome = outcome


class _Slots:
    """A judge's cap: ``cap`` slots, each with an HTTP client of one connection, made at its first use.

    One pool of ``cap`` connections would do too, but httpx looks at every connection of its pool on each
    request (whether an idle one was closed by the server), which makes a request's cost here grow with the cap.
    The free slots are a stack: with few requests in flight, the same few connections serve them all. A freed
    slot goes to the completion that has waited longest (see :class:`~proctor.server.grading.handoff.HandOff`)."""

    def __init__(self, cap: int, ssl_context: Callable[[], ssl.SSLContext]) -> None:
        self._free: HandOff[int] = HandOff(reversed(range(cap)))
        self._clients: dict[int, httpx.AsyncClient] = {}
        self._ssl_context = ssl_context

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[httpx.AsyncClient]:
        """Wait for a free slot; its client for the body."""
        slot = await self._free.get()
        try:
            client = self._clients.get(slot)
            if client is None:
                limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
                client = httpx.AsyncClient(limits=limits, verify=self._ssl_context(), follow_redirects=False)
                self._clients[slot] = client
            yield client
        finally:
            self._free.put(slot)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


class JudgeClient:
    """Every judge call of one server (or grade-worker, or regrade): one per completion, at most
    ``max_concurrency`` of a judge at once, whichever ``/grade`` they come from. Close it with :meth:`aclose`.

    ``backoff_s`` is the first retry's wait, doubled for each one after it, never above ``max_backoff_s`` (nor a
    ``Retry-After`` above it); each wait is drawn between its half and its whole.
    """

    def __init__(
        self,
        api_key: SecretStr | None = None,
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        self._api_key = api_key
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._slots: dict[tuple[str, str, int], _Slots] = {}
        self._ssl: ssl.SSLContext | None = None

    def __repr__(self) -> str:
        return f"JudgeClient(api_key={'set' if self._api_key is not None else 'unset'}, judges={len(self._slots)})"

    async def aclose(self) -> None:
        """Close every judge's connections."""
        for slots in self._slots.values():
            await slots.aclose()

    def _ssl_context(self) -> ssl.SSLContext:
        # One for every slot's client: making one reads the CA bundle, milliseconds each.
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    def _gate(self, judge: JudgeGrader) -> _Slots:
        # One cap per judge the curriculum declares: its sources share it, whatever their rubrics.
        key = (judge.name, judge.url, judge.max_concurrency)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = _Slots(judge.max_concurrency, self._ssl_context)
        return slots

    async def grade(self, judge: JudgeGrader, items: Sequence[GradeInput]) -> list[GraderOutcome]:
        """The judge's outcome for each of ``items``, in order."""
        return list(await asyncio.gather(*(self.grade_one(judge, sample) for sample in items)))

    async def grade_one(self, judge: JudgeGrader, sample: GradeInput) -> GraderOutcome:
        name = repr(judge.key)
        try:
            prompt = render_rubric(judge.rubric, sample)
        except MissingAnswer:
            return GraderOutcome.failed(
                FailureKind.ERROR, f"judge {name}: its rubric names {{answer}}, and this record has no reference answer"
            )
        deadline = time.monotonic() + judge.deadline_s
        try:
            async with asyncio.timeout(judge.deadline_s), self._gate(judge).slot() as http:
                text = await self._ask(http, judge, prompt, deadline)
        except TimeoutError:
            return GraderOutcome.failed(
                FailureKind.TIMEOUT, f"judge {name} gave no verdict within its deadline of {judge.deadline_s:g}s"
            )
        except _Verdict as verdict:
            return verdict.outcome
        return read_score(judge, self._blot(text))

    async def _ask(self, http: httpx.AsyncClient, judge: JudgeGrader, prompt: str, deadline: float) -> str:
        """The text of the judge's answer to ``prompt``; raises :class:`_Verdict` when none came."""
        name = repr(judge.key)
        url = judge.url.rstrip("/")
        if not url.endswith("/chat/completions"):
            url += "/chat/completions"
        body = {
            "model": judge.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": judge.max_tokens,
            "temperature": judge.temperature,
        }
        headers = {} if self._api_key is None else {"Authorization": f"Bearer {self._api_key.get_secret_value()}"}
        tries = judge.retries + 1
        for attempt in range(tries):
            retry_after: float | None = None
            try:
                async with asyncio.timeout(judge.timeout_s):
                    response = await http.post(url, json=body, headers=headers, timeout=httpx.Timeout(judge.timeout_s))
            except (TimeoutError, httpx.TimeoutException):
                # Not tried again: a judge that did not answer in time is stuck or overloaded, and a second request
                # would only add to its load.
                raise _Verdict(
                    GraderOutcome.failed(
                        FailureKind.TIMEOUT, f"judge {name} did not answer within {judge.timeout_s:g}s"
                    )
                ) from None
            except httpx.HTTPError as exc:
                failure = f"judge {name} unreachable: {type(exc).__name__}: {self._blot(str(exc))}"
            else:
                if response.status_code == 200:
                    return self._content(judge, response)
                failure = (
                    f"judge {name} answered HTTP {response.status_code}: {self._blot(response.text[:QUOTED_CHARS])}"
                )
                if response.status_code != 429 and response.status_code < 500:
                    raise _Verdict(GraderOutcome.failed(FailureKind.REMOTE, failure))
                retry_after = _retry_after(response.headers.get("retry-after"))
            if attempt + 1 == tries:
                break
            wait = self._wait(attempt, retry_after)
            if time.monotonic() + wait >= deadline:
                failure += "; its deadline came before the next try"
                break
            log.debug("judge %s: %s; trying again in %.2fs", name, failure, wait)
            await asyncio.sleep(wait)
        raise _Verdict(GraderOutcome.failed(FailureKind.REMOTE, f"{failure} ({attempt + 1} of {tries} tries)"))

    def _wait(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        full = min(self.max_backoff_s, self.backoff_s * 2.0**attempt)
        return full / 2 + random.uniform(0, full / 2)

    def _content(self, judge: JudgeGrader, response: httpx.Response) -> str:
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            quoted = self._blot(response.text[:QUOTED_CHARS])
            raise _Verdict(
                GraderOutcome.failed(
                    FailureKind.REMOTE,
                    f"judge {judge.key!r} sent no chat completion (choices[0].message.content): {quoted}",
                )
            ) from None
        return content if isinstance(content, str) else ""  # null: a refusal, or only tool calls

    def _blot(self, text: str) -> str:
        """``text`` with the API key blotted out, should the judge have echoed it."""
        if self._api_key is None:
            return text
        secret = self._api_key.get_secret_value()
        return text.replace(secret, "**********") if secret else text


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait by a ``Retry-After`` header (seconds, or an HTTP date), or None when it says nothing."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None
