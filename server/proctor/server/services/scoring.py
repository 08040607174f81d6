"""The scoring service: completions named by a label rather than by a served step and slot (``POST /score``,
and the other trainers' reward-server protocols that map onto it).

A label that is a sample id names the record the completion answers: it is graded like an item of ``/grade``
without ``iteration`` (through the experience store, counted in the curriculum's statistics for the latest step
that served the record). Any other label is the reference answer of the default source
(``PROCTOR_PEER_DEFAULT_SOURCE``): that source's graders grade the completion against it, in this server's
grader processes; nothing is stored, since no record or step is named.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from proctor.server.exceptions import InvalidRequestError, UnavailableError
from proctor.server.grading.base import GradeInput
from proctor.server.grading.compose import compose
from proctor.server.grading.fanout import GraderFanout
from proctor.server.services.context import ServingContext
from proctor.server.services.grading import GradingService
from proctor.server.sources.base import SampleId
from proctor.wire import dataserver as wire
from proctor.wire import peers

__all__ = ["FieldName", "ScoringService", "response_of"]

FieldName = Callable[[str, int], str]
"""How a protocol names an item's field in an error: ``(field, index) -> name``, field being ``response`` or
``label``."""

# Special tokens a decode with skip_special_tokens=False leaves after a response (OpenRLHF's query is decoded so).
_TRAILING_SPECIAL = re.compile(r"(?:\s*(?:<\|[^|<>\s]{1,40}\|>|</s>|<eos>|<pad>|<end_of_turn>))+\s*$")


def _indexed(field: str, n: int) -> str:
    return f"items[{n}].{field}"


def response_of(query: str, prompt: str | None) -> str:
    """The response in a query that is the prompt and the response decoded together, without the special tokens
    that end it. A prompt cut short from the left (OpenRLHF keeps a long prompt's last tokens) is matched by its
    longest end that the query starts with."""
    if prompt:
        query = query[len(prompt) :] if query.startswith(prompt) else query[_overlap(prompt, query) :]
    return _TRAILING_SPECIAL.sub("", query)


def _overlap(prompt: str, query: str) -> int:
    """The length of the longest end of ``prompt`` that ``query`` starts with, in linear time (the prefix
    function of ``query``'s start, a separator, and ``prompt``)."""
    text = query[: len(prompt)] + "\0" + prompt
    border = [0] * len(text)
    for i in range(1, len(text)):
        k = border[i - 1]
        while k and text[i] != text[k]:
            k = border[k - 1]
        if text[i] == text[k]:
            k += 1
        border[i] = k
    return border[-1]


class ScoringService:
    def __init__(self, ctx: ServingContext, grading: GradingService, fanout: GraderFanout | None) -> None:
        self.ctx = ctx
        self.grading = grading
        self.fanout = fanout

    async def score(self, items: Sequence[peers.ScoreItem], field: FieldName = _indexed) -> list[peers.ScoreResult]:
        """Each item's reward, in order. ``field`` names an item's field in a refusal as the caller's protocol
        does."""
        s = self.ctx.settings
        if len(items) > s.max_grade_items:
            raise InvalidRequestError(
                "items",
                f"{len(items)} completions is above this server's maximum of {s.max_grade_items} per request "
                "(PROCTOR_MAX_GRADE_ITEMS); split the request",
            )
        named: list[int] = []
        unnamed: list[int] = []
        for n, item in enumerate(items):
            if len(item.response) > s.max_completion_chars:
                raise InvalidRequestError(
                    field("response", n),
                    f"{len(item.response)} characters is above this server's maximum of {s.max_completion_chars} "
                    "(PROCTOR_MAX_COMPLETION_CHARS)",
                )
            if item.label is not None and self._names_record(item.label, field("label", n)):
                named.append(n)
            else:
                unnamed.append(n)
        if unnamed and s.peer_default_source is None:
            n = unnamed[0]
            raise InvalidRequestError(
                field("label", n),
                f"{items[n].label!r} is not a sample id, so it names no record, and this server has no default "
                "source to grade against a reference answer: send the sample id /sample served, or set "
                "PROCTOR_PEER_DEFAULT_SOURCE",
            )
        results: list[peers.ScoreResult | None] = [None] * len(items)
        if named:
            request = wire.GradeRequest(
                items=[wire.GradeItem(sample_id=items[n].label or "", completion=items[n].response) for n in named]
            )
            graded = (await self.grading.grade(request)).results
            for n, r in zip(named, graded, strict=True):
                results[n] = peers.ScoreResult(
                    reward=r.reward, components=r.components, error=r.error, sample_id=r.sample_id
                )
        if unnamed:
            for n, result in zip(unnamed, await self._default([items[n] for n in unnamed]), strict=True):
                results[n] = result
        return [r for r in results if r is not None]

    def _names_record(self, label: str, name: str) -> bool:
        """Whether ``label`` is a sample id; one of a record this server does not have is refused."""
        try:
            sid = SampleId.parse(label)
        except ValueError:
            return False
        src = self.ctx.curriculum.sources.get(sid.source)
        if src is None:
            known = ", ".join(sorted(self.ctx.curriculum.sources))
            raise InvalidRequestError(
                name, f"{label!r} names source {sid.source!r}, which this server does not have (it has: {known})"
            )
        if sid.version == src.version and src.size is not None and not 0 <= sid.key < src.size:
            raise InvalidRequestError(name, f"{label!r} names record {sid.key}; source {sid.source!r} has {src.size}")
        return True

    async def _default(self, items: Sequence[peers.ScoreItem]) -> list[peers.ScoreResult]:
        """The default source's graders, against each item's label as the reference answer."""
        source = self.ctx.settings.peer_default_source
        assert source is not None
        if self.fanout is None:
            raise UnavailableError(
                "completions whose label names no record are graded in this server's grader processes, and it runs "
                "none (PROCTOR_GRADER_WORKERS=0): send sample ids, or start the server with grader processes"
            )
        graders = self.ctx.curriculum.graders[source]
        work = [(graders, GradeInput(prompt=it.prompt or "", completion=it.response, answer=it.label)) for it in items]
        out = []
        for outcomes in await self.fanout.grade(work):
            grade = compose(graders, outcomes)
            out.append(
                peers.ScoreResult(reward=grade.reward, components=grade.components, error=grade.error, sample_id=None)
            )
        return out
