"""``ProctorClient``: the typed HTTP client of the dataserver.

Usage::

    with ProctorClient("http://127.0.0.1:8000", api_key=None) as client:
        client.wait_ready()
        batch = client.sample(iteration=0, batch_size=16)
        results = client.grade([GradeItem(sample_id=s.sample_id, completion="42") for s in batch.samples])

Every call is safe to repeat (``/sample`` answers the same batch for the same request, ``/grade`` answers a
stored result for a completion it graded before), so the client retries connection errors, timeouts, 429
and 5xx answers with exponential backoff and jitter, honouring ``Retry-After``. Other 4xx answers are the
caller's mistake and are raised at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from proctor.client.errors import DataserverError, NotReadyError, TransportError, error_for
from proctor.wire.dataserver import (
    CurriculumState,
    GradeItem,
    GradeRequest,
    GradeResponse,
    GradeResult,
    Graders,
    Health,
    Meta,
    RefillRequest,
    RefillResponse,
    SampleRequest,
    SampleResponse,
)
from proctor.wire.peers import ScoreItem, ScoreRequest, ScoreResponse, ScoreResult

_Item = TypeVar("_Item", GradeItem, ScoreItem)

__all__ = ["DEFAULT_TIMEOUT", "ProctorClient"]

M = TypeVar("M", bound=BaseModel)

# Grading a large batch can legitimately take a while; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=5.0)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class ProctorClient:
    """A long-lived connection pool to one dataserver.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        api_key: the server's ``PROCTOR_API_KEY``, sent as a bearer token.
        timeout: an ``httpx.Timeout`` (or seconds) per attempt.
        retries: attempts after the first one, for retryable failures.
        backoff: first retry delay in seconds; doubles on each retry, with ±50 % jitter.
        max_backoff: the longest single delay (a ``Retry-After`` above it is cut to it too).
        transport: an ``httpx`` transport, e.g. ``httpx.MockTransport`` in tests.
        sleep: the function used to wait between retries (tests pass a recorder).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 6,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be ≥ 0, got {retries}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # What a copy in another process (a DataLoader worker) needs to reconnect; see __getstate__.
        self._config = {
            "base_url": base_url,
            "api_key": api_key,
            "timeout": timeout,
            "retries": retries,
            "backoff": backoff,
            "max_backoff": max_backoff,
        }
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._sleep = sleep
        self._rng = random.Random()
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._grade_limits: tuple[int, int] | None = None  # (max items, max body bytes) of a /grade, from /meta

    # --- the API ------------------------------------------------------------------------------------------

    def meta(self) -> Meta:
        """Stages, total iterations, seed, curriculum hash, sources and the server's request limits."""
        meta = self._call("GET", "/meta", Meta)
        self._grade_limits = (meta.max_grade_items, meta.max_body_bytes)
        return meta

    def sample(
        self, iteration: int, batch_size: int, *, rank: int | None = None, world_size: int | None = None
    ) -> SampleResponse:
        """The prompts of generation step ``iteration`` (or a rank's share of them)."""
        body = SampleRequest(iteration=iteration, batch_size=batch_size, rank=rank, world_size=world_size)
        return self._call("POST", "/sample", SampleResponse, body)

    def refill(self, iteration: int, round_: int, group_size: int) -> RefillResponse:
        """Refill round ``round_`` of a graded step: the groups to replace and their replacing prompts (the
        same answer for every rank, retry and restart)."""
        body = RefillRequest(iteration=iteration, round=round_, group_size=group_size)
        return self._call("POST", "/refill", RefillResponse, body)

    def score(self, items: Iterable[ScoreItem]) -> ScoreResponse:
        """Rewards for completions named by label (``POST /score``): a sample id, or a reference answer for the
        server's default source."""
        results: list[ScoreResult] = []
        envelope = len(ScoreRequest.model_construct(items=[]).model_dump_json())
        for part in self._parts(list(items), envelope):
            results.extend(self._call("POST", "/score", ScoreResponse, ScoreRequest(items=part)).results)
        return ScoreResponse(results=results)

    def grade(self, items: Iterable[GradeItem], *, iteration: int | None = None) -> GradeResponse:
        """Rewards for completions; results carry ``(slot or sample_id, completion_index)`` to match them by.

        Completions beyond one request's limits (the server's ``max_grade_items`` and ``max_body_bytes``,
        read from ``/meta`` on the first call) are sent as several requests, in order, answered as one.
        """
        results: list[GradeResult] = []
        envelope = len(GradeRequest(iteration=iteration, items=[]).model_dump_json())
        for part in self._parts(list(items), envelope):
            results.extend(
                self._call("POST", "/grade", GradeResponse, GradeRequest(iteration=iteration, items=part)).results
            )
        return GradeResponse(results=results)

    def _parts(self, items: list[_Item], envelope: int) -> Iterator[list[_Item]]:
        """``items`` in requests within the server's limits (``max_grade_items``, ``max_body_bytes``, read from
        ``/meta`` once); ``envelope`` is the size of a request without them."""
        if self._grade_limits is None:
            self.meta()
        assert self._grade_limits is not None
        max_items, max_bytes = self._grade_limits
        # Sizes as sent (compact JSON), with room for the envelope and a margin for encoder differences.
        budget = int(max_bytes * 0.95) - envelope
        part: list[_Item] = []
        size = 0
        for item in items:
            item_size = len(item.model_dump_json(exclude_none=True).encode()) + 1
            if part and (len(part) == max_items or size + item_size > budget):
                yield part
                part, size = [], 0
            part.append(item)
            size += item_size
        if part or not items:
            yield part

    def graders(self) -> Graders:
        """Each source's graders as the server resolved them (what ``proctor grade-worker`` runs)."""
        return self._call("GET", "/graders", Graders)

    def curriculum(self) -> CurriculumState:
        """The live curriculum state: current stage, transitions, per-stage statistics."""
        return self._call("GET", "/curriculum", CurriculumState)

    def health(self) -> Health:
        return self._call("GET", "/healthz", Health)

    def wait_ready(self, timeout: float = 60.0, *, interval: float = 0.25) -> Health:
        """Poll ``/healthz`` until it answers 200, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            try:
                response = self._http.get("/healthz", timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if response.status_code == 200:
                    return Health.model_validate(response.json())
                last = error_for(response)
            except httpx.TransportError as exc:
                last = exc
            if time.monotonic() + interval > deadline:
                raise NotReadyError(
                    f"the dataserver at {self.base_url} was not ready after {timeout:g}s (last: {last}); "
                    "is `proctor serve` running there?"
                )
            self._sleep(interval)

    # --- plumbing -----------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, model: type[M], body: BaseModel | None = None) -> M:
        response = self._send(method, path, body)
        try:
            return model.model_validate(response.json())
        except ValueError as exc:  # not JSON, or not the expected shape (pydantic's error is a ValueError)
            raise DataserverError(
                f"{method} {response.request.url} answered {response.status_code} but not with a {model.__name__}: "
                f"{str(exc)[:300]}; is {self.base_url} a proctor dataserver of a compatible version?",
                request=response.request,
            ) from exc

    def _send(self, method: str, path: str, body: BaseModel | None) -> httpx.Response:
        # Encoded here, by the same encoder that _parts sizes requests with (httpx's own JSON encoding
        # differs between versions: before 0.28 it escaped every non-ASCII character to six bytes).
        content = None if body is None else body.model_dump_json(exclude_none=True).encode()
        headers = None if body is None else {"Content-Type": "application/json"}
        request = self._http.build_request(method, path, content=content, headers=headers)
        for attempt in range(self.retries + 1):
            last_attempt = attempt == self.retries
            try:
                response = self._http.send(request)
            except httpx.TransportError as exc:
                if last_attempt:
                    tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
                    raise TransportError(
                        f"{method} {request.url} failed after {tries}: {type(exc).__name__}: {exc}", request=request
                    ) from exc
                self._sleep(self._delay(attempt, None))
                continue
            if response.status_code < 400:
                return response
            if response.status_code in _RETRY_STATUS and not last_attempt:
                self._sleep(self._delay(attempt, response.headers.get("retry-after")))
                continue
            raise error_for(response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None:
            try:
                seconds: float = float(retry_after)
                return min(self.max_backoff, max(0.0, seconds))
            except ValueError:
                pass  # an HTTP date: fall back to our own schedule
        jittered: float = self.backoff * 2**attempt * self._rng.uniform(0.5, 1.5)
        return min(self.max_backoff, jittered)

    def close(self) -> None:
        self._http.close()

    def __getstate__(self) -> dict[str, Any]:
        # A connection pool does not travel between processes; its settings do.
        return dict(self._config)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __enter__(self) -> ProctorClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
