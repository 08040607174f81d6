"""``/grade`` on a standby: a standby of a PostgreSQL database grades a step's completions itself, and the server
that serves the database stores them.

A standby forwards every other request to the serving server (:mod:`proctor.server.middleware`). A ``/grade`` of
a sampled step is the exception: most of its work needs nothing of the run's memory (parsing and checking the
request, the step's batch and the stored grades, read from the database, grading on the standby's own grader
processes, composing the answer). What must happen where the run's experience store and statistics live is one
call, :meth:`~proctor.server.services.rollouts.Rollouts.write_graded` on the serving server, which the standby
makes over HTTP with the completions graded (``POST /replica/graded``, :mod:`proctor.server.routes.replica`); and
for rows another holder of the grader role held first, :meth:`~proctor.server.services.rollouts.Rollouts.rewards`
(``POST /replica/rewards``). A request the standby cannot place (without an iteration, or of one the database does
not hold yet) goes to the serving server whole, as any other request does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpcore
import httpx

from proctor.errors import ProctorError
from proctor.experience import RowKey, Value
from proctor.experience import columns as col
from proctor.experience.database import error_line
from proctor.server.curriculum.loader import Curriculum
from proctor.server.exceptions import InvalidRequestError, RelayedError, UnavailableError
from proctor.server.grading.fanout import GraderFanout
from proctor.server.grading.pool import GraderPool
from proctor.server.grading.registry import local_refs
from proctor.server.metrics import Metrics
from proctor.server.services.grading import GradingContext, GradingService
from proctor.server.services.placement import Completion, Graded
from proctor.server.services.rollouts import Written
from proctor.server.settings import Settings
from proctor.server.sources.base import SampleId
from proctor.server.state.rows import NO_SLOT, GradeKey, GradeRow
from proctor.server.store import StandbyReads, StateUnreachableError
from proctor.wire import dataserver as wire

__all__ = [
    "TOKEN_HEADER",
    "ServedElsewhere",
    "ServingSteps",
    "StandbyGrading",
    "decode_graded",
    "decode_rewards_wait",
    "encode_rewards",
    "encode_written",
]

T = TypeVar("T")
TOKEN_HEADER = "x-proctor-replica-token"
_TIMEOUT: dict[str, Any] = {"timeout": {"connect": 2.0}}  # then as long as the serving server takes
_TRANSPORT_ERRORS = (
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
)
_BATCHES_KEPT = 256  # steps whose stage a standby remembers (a step's stage never changes once sampled)


class ServedElsewhere(ProctorError):
    """A ``/grade`` that only the serving server can place: it goes there whole."""


Serving = Callable[[], "tuple[str, str] | None"]
"""The serving server's URL and token, None while none is known."""


class _Reads:
    """The standby's read-only connection to the database, opened again after the database failed it (a
    restart, a failover): meanwhile each read is a 503."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._reads: StandbyReads | None = None  # opened by the first read
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proctor-standby-reads")
        self._closed = False

    async def run(self, read: Callable[[StandbyReads], T]) -> T:
        # On a thread of its own: each read is a round trip to the database, which would hold the event loop.
        if self._closed:  # this server no longer stands by: a request begun before it took over
            raise UnavailableError("this server stopped standing by while the request was graded; retry")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run, read)

    def _run(self, read: Callable[[StandbyReads], T]) -> T:
        try:
            if self._reads is None:
                self._reads = StandbyReads(self._path)
            return read(self._reads)
        except StateUnreachableError as exc:
            raise UnavailableError(f"{exc}; retry") from None
        except Exception as exc:
            if self._reads is None or not isinstance(exc, self._reads.errors):
                raise
            self._close()
            raise UnavailableError(f"the state database failed a read ({error_line(exc)}); retry") from None

    async def close(self) -> None:
        # On its thread, after any read in flight, without holding the event loop meanwhile.
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)
        self._thread.shutdown()

    def _close(self) -> None:
        if self._reads is not None:
            with contextlib.suppress(Exception):
                self._reads.close()
            self._reads = None


class _StandbyLookups:
    """The stored grades, as the standby reads them from the database (the serving server's queries)."""

    def __init__(self, reads: _Reads) -> None:
        self._reads = reads

    def check_healthy(self) -> None:
        return None

    async def graded_iterations(self, iterations: Iterable[int]) -> set[int]:
        wanted = list(iterations)
        return await self._reads.run(lambda r: r.graded_iterations(wanted))

    async def find_grades(self, keys: Iterable[GradeKey]) -> dict[GradeKey, GradeRow]:
        wanted = list(keys)
        return await self._reads.run(lambda r: r.find_grades(wanted))

    async def latest_served(self, sample_ids: Iterable[str]) -> dict[str, int]:
        # The serving server holds the latest steps' ids in memory before it writes them: only it can tell.
        raise ServedElsewhere("a /grade without iteration")


class ServingSteps:
    """The served steps as a standby sees them (each sampled step's batch, read from the database), and the
    serving server's experience store, reached over HTTP (httpcore's connection pool rather than an httpx
    client: each ``/grade`` makes such a call, and httpx's layers took more of the standby's interpreter than the
    request's own encoding)."""

    def __init__(
        self,
        reads: _Reads,
        peers: httpcore.AsyncConnectionPool,
        serving: Serving,
        unreachable: Callable[[], None],
        api_key: str | None,
    ) -> None:
        self._reads = reads
        self._peers = peers
        self._serving = serving
        self._unreachable = unreachable
        self._api_key = api_key
        self._stages: OrderedDict[int, int] = OrderedDict()  # the latest placed last

    @property
    def last_iteration(self) -> int | None:
        return None  # only asked of requests without an iteration, which go to the serving server

    def stage_of(self, iteration: int) -> int:
        # Read with the step's batch, which a standby places first (the oldest stages are forgotten first, so the
        # one just read is kept).
        stage = self._stages.get(iteration)
        if stage is None:
            raise ServedElsewhere(f"the stage of iteration {iteration} was not read with its batch")
        return stage

    async def sample_ids(self, iteration: int) -> Sequence[str] | None:
        # Read each time rather than kept: a refill round may extend a step's batch after it was sampled.
        row = await self._reads.run(lambda r: r.get_iteration(iteration))
        if row is None:
            # Not sampled yet, or in a commit not yet visible: the serving server decides what it is.
            raise ServedElsewhere(f"iteration {iteration} is not in the database")
        self._stages[iteration] = row.stage
        self._stages.move_to_end(iteration)
        while len(self._stages) > _BATCHES_KEPT:
            self._stages.popitem(last=False)
        return tuple(s["sample_id"] for s in row.samples)

    async def write_graded(self, graded: Sequence[Graded], *, lease_s: float) -> Written:
        items = [
            [
                g.completion.step,
                g.completion.step_slot,
                g.completion.sample_id,
                g.completion.completion_index,
                g.completion.completion,
                g.completion.completion_tokens,
                g.completion.position,
                g.completion.regrade,
                g.reward,
                g.detail,
                g.grade.stage,
                g.grade.source,
                g.grade.key[4],
            ]
            for g in graded
        ]
        answer = await self._post("/replica/graded", {"lease_s": lease_s, "items": items})
        rows = [(t, s, i) for t, s, i in answer["rows"]]
        return Written(rows, {rows[n] for n in answer["collected"]}, {_key(k) for k in answer["raced"]})

    async def enqueue(self, completions: Sequence[Completion]) -> list[tuple[int, int, int]]:
        raise ServedElsewhere("remote grade-workers grade for the serving server")

    async def rewards(
        self, table: int, rows: Sequence[RowKey], timeout_s: float, *, written_now: bool = False
    ) -> dict[str, list[Value]]:
        body = {"table": table, "rows": [list(r) for r in rows], "timeout_s": timeout_s, "written_now": written_now}
        answer = await self._post("/replica/rewards", body)
        return {col.REWARD: answer["reward"], col.REWARD_DETAIL: answer["reward_detail"]}

    async def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        serving = self._serving()
        if serving is None:
            raise UnavailableError("this server stands by and no serving server is known yet; retry")
        url, token = serving
        headers = [(TOKEN_HEADER.encode(), token.encode()), (b"content-type", b"application/json")]
        if self._api_key is not None:
            headers.append((b"authorization", f"Bearer {self._api_key}".encode()))
        try:
            answer = await self._peers.request(
                "POST", url.rstrip("/") + path, headers=headers, content=json.dumps(body).encode(), extensions=_TIMEOUT
            )
        except _TRANSPORT_ERRORS as exc:
            self._unreachable()  # the standby looks at the database's lock now, not at its next look
            raise UnavailableError(
                f"this server stands by, and the serving one at {url} does not answer ({type(exc).__name__}); "
                "a standby takes over within seconds: retry"
            ) from None
        if answer.status != 200:
            try:
                refused = json.loads(answer.content)
                detail, code = str(refused["detail"]), refused.get("code")
            except (ValueError, KeyError, TypeError):
                detail, code = f"the serving server at {url} answered {answer.status}", None
            raise RelayedError(answer.status, detail, code=code)
        return json.loads(answer.content)


class StandbyGrading:
    """A standby's ``/grade``: its own grader processes and the serving server's store. Create with
    :meth:`start`, release with :meth:`close`."""

    def __init__(
        self,
        service: GradingService,
        pool: GraderPool,
        fanout: GraderFanout,
        reads: _Reads,
        http: httpx.AsyncClient,
        peers: httpcore.AsyncConnectionPool,
        metrics: Metrics,
    ) -> None:
        self._service = service
        self._metrics = metrics
        self._pool = pool
        self._fanout = fanout
        self._reads = reads
        self._http = http
        self._peers = peers

    @classmethod
    async def start(
        cls,
        curriculum: Curriculum,
        settings: Settings,
        metrics: Metrics,
        path: str,
        serving: Serving,
        unreachable: Callable[[], None],
    ) -> StandbyGrading:
        """``serving`` says where the serving server is; ``unreachable`` is called when it does not answer."""
        reads = _Reads(path)
        pool = GraderPool(settings.grader_workers, graders=local_refs(curriculum.graders))
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0), follow_redirects=False)
        peers = httpcore.AsyncConnectionPool()
        try:
            await pool.start()
        except BaseException:
            await http.aclose()
            await peers.aclose()
            await reads.close()
            raise
        timeout_s = settings.grader_timeout_s
        fanout = GraderFanout(pool, http, metrics, timeout_s, judge_api_key=settings.judge_api_key)
        api_key = None if settings.api_key is None else settings.api_key.get_secret_value()
        steps = ServingSteps(reads, peers, serving, unreachable, api_key)
        ctx = GradingContext(curriculum, settings, metrics, _StandbyLookups(reads), steps)
        return cls(GradingService(ctx, fanout), pool, fanout, reads, http, peers, metrics)

    async def grade(self, req: wire.GradeRequest) -> wire.GradeResponse:
        """Like the serving server's ``/grade``; raises :class:`ServedElsewhere` (before anything is written) for
        a request only the serving server can place."""
        if req.iteration is None:
            raise ServedElsewhere("a /grade without iteration")
        answer = await self._service.grade(req)
        self._metrics.graded_standing_by.inc(sum(not r.cached for r in answer.results))
        return answer

    async def close(self) -> None:
        await self._pool.close()
        await self._fanout.aclose()
        await self._http.aclose()
        await self._peers.aclose()
        await self._reads.close()


def _key(value: Sequence[Any]) -> GradeKey:
    return (int(value[0]), str(value[1]), int(value[2]), int(value[3]), str(value[4]))


# The serving server's side of the protocol (routes/replica.py).


def decode_graded(body: bytes, curriculum: Curriculum) -> tuple[list[Graded], float]:
    """A standby's ``POST /replica/graded``: the completions it graded, and the lease to write them under."""
    try:
        data = json.loads(body)
        lease_s = float(data["lease_s"])
        graded = []
        for item in data["items"]:
            (step, slot, sample_id, index, completion, tokens, position, regrade) = item[:8]
            reward, detail, stage, source, sha = item[8:]
            sid = SampleId.parse(sample_id)
            record = curriculum.sources[sid.source].record(sid.key)
            # The standby's digest of the completion (see grade_key): the serving server is the busier of the two.
            key: GradeKey = (step, sample_id, NO_SLOT if slot is None else slot, index, str(sha))
            c = Completion(step, slot, sample_id, index, completion, tokens, record, position=position, regrade=regrade)
            row = GradeRow(key, stage, source, float(reward), *col.parse_reward_detail(detail))
            graded.append(Graded(c, float(reward), detail, row))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise InvalidRequestError("items", f"not a standby's graded completions ({type(exc).__name__})") from None
    return graded, lease_s


def encode_written(written: Written) -> bytes:
    at = {row: n for n, row in enumerate(written.rows)}
    collected = sorted(at[row] for row in written.collected)
    return json.dumps({"rows": written.rows, "collected": collected, "raced": sorted(written.raced)}).encode()


def decode_rewards_wait(body: bytes) -> tuple[int, list[RowKey], float, bool]:
    """A standby's ``POST /replica/rewards``: the table, its rows, how long to wait, and whether it wrote them."""
    try:
        data = json.loads(body)
        rows: list[RowKey] = [(int(s), int(i)) for s, i in data["rows"]]
        return int(data["table"]), rows, float(data["timeout_s"]), bool(data["written_now"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError("rows", f"not a standby's wait for rewards ({type(exc).__name__})") from None


def encode_rewards(values: Mapping[str, Sequence[Value]]) -> bytes:
    return json.dumps({"reward": values[col.REWARD], "reward_detail": values[col.REWARD_DETAIL]}).encode()
