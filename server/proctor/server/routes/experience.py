"""``/experience``: the experience store over HTTP (tables per iteration, consumers, dispatch and collect).

Each route is one call of :class:`~proctor.experience.ExperienceStore`, with the same meaning and the same errors
(their class in the answer's ``code``), which the experience client raises again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from proctor.experience import ExperienceStore
from proctor.server.dataserver import Dataserver
from proctor.server.deps import DataserverDep, json_body
from proctor.server.errors import error_responses
from proctor.server.openapi import request_body
from proctor.wire import experience as dw

router = APIRouter(prefix="/experience", tags=["experience store"], responses=error_responses(400, 413, 415, 422, 503))

IterationPath = Annotated[
    int,
    Path(
        ge=-(2**62),
        le=2**62,
        description="The table: a generation step, or -(step + 1) for the loose completions of that step.",
    ),
]
NamePath = Annotated[str, Path(min_length=1, max_length=64, description="The consumer's name.")]
LeasePath = Annotated[str, Path(min_length=1, max_length=64, description="The lease a dispatch returned.")]


def _json(model: dw._Wire) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


@router.get("", response_model=dw.ExperienceOverview)
async def overview(server: DataserverDep) -> Response:
    """The tables kept (with the cells written per column) and the consumers."""
    x = server.experience
    return await x.call(_overview, x.store)


def _overview(experience: ExperienceStore) -> Response:
    return _json(
        dw.ExperienceOverview(
            keep_iterations=experience.keep_iterations,
            tables=[dw.TableBody.of(t) for t in experience.tables()],
            consumers=[dw.ConsumerBody.of(c) for c in experience.consumers()],
        )
    )


@router.put(
    "/tables/{iteration}",
    response_model=dw.TableBody,
    openapi_extra=request_body(dw.OpenRequest),
    responses=error_responses(404, 409),
)
async def open_table(
    iteration: IterationPath,
    body: Annotated[dw.OpenRequest, Depends(json_body(dw.OpenRequest))],
    server: DataserverDep,
) -> Response:
    """Create the step's table of ``slots × group_size`` rows, or check its shape (idempotent); a table that
    ``/sample`` opened without a group size takes this one.

    For a step this server sampled, ``slots`` is its batch size, and every row gets the columns of its prompt:
    ``sample_id``, ``prompt``, ``reference`` (answer and metadata, for graders) and ``stage``.
    """
    info = await server.rollouts.open(iteration, body.slots, body.group_size)
    return _json(dw.TableBody.of(info))


@router.get("/tables/{iteration}", response_model=dw.TableBody, responses=error_responses(404))
async def get_table(iteration: IterationPath, server: DataserverDep) -> Response:
    x = server.experience
    return _json(dw.TableBody.of(await x.call(x.store.table, iteration)))


@router.post(
    "/tables/{iteration}/rows",
    status_code=204,
    openapi_extra=request_body(dw.PutRequest),
    responses={
        200: {"model": dw.ReadBody, "description": "The ``read`` columns of the rows written."},
        **error_responses(404, 409),
    },
)
async def put_rows(
    iteration: IterationPath,
    body: Annotated[dw.PutRequest, Depends(json_body(dw.PutRequest))],
    server: DataserverDep,
) -> Response:
    """Write cells (each column once per row; the same value again is a no-op). With ``read``, then answer
    those columns of the same rows as ``/read`` does with ``wait_s``: a writer that waits for what a role
    makes of its rows (the grader's rewards) needs one request, not two."""
    if not body.read:
        await server.rollouts.put(iteration, body)
        return Response(status_code=204)
    if server.grader_role is None:
        await server.rollouts.put(iteration, body)
    else:
        cells = await server.grader_role.grade_written(iteration, body)
        if cells is not None and all(cell is not None for column in cells.values() for cell in column):
            return Response(dw.read_json(cells), media_type="application/json")
    # The fields were checked as the put's: built, not validated again (up to 65,536 rows).
    read = dw.ReadRequest.model_construct(rows=body.rows, columns=body.read, wait_s=body.wait_s)
    return await _answer_read(server, iteration, read)


@router.post(
    "/tables/{iteration}/read",
    response_model=dw.ReadBody,
    openapi_extra=request_body(dw.ReadRequest),
    responses=error_responses(404, 409),
)
async def read_rows(
    iteration: IterationPath,
    body: Annotated[dw.ReadRequest, Depends(json_body(dw.ReadRequest))],
    server: DataserverDep,
) -> Response:
    """The values of cells, by index. Unwritten cells are a 409, or nulls with ``missing: none``; with
    ``wait_s``, the 409 comes only once that long passed without them being written."""
    return await _answer_read(server, iteration, body)


async def _answer_read(server: Dataserver, iteration: int, body: dw.ReadRequest) -> Response:
    x = server.experience
    if body.wait_s > 0 and body.missing == "error":
        return await server.rollouts.when_written(
            iteration, body.wait_s, lambda: x.call(_read, x.store, iteration, body)
        )
    return await x.call(_read, x.store, iteration, body)


def _read(experience: ExperienceStore, iteration: int, body: dw.ReadRequest) -> Response:
    cells = experience.read_cells(iteration, body.rows, body.columns, missing=body.missing)
    return Response(dw.read_json(cells), media_type="application/json")


@router.put(
    "/consumers/{name}",
    response_model=dw.ConsumerBody,
    openapi_extra=request_body(dw.RegisterRequest),
    responses=error_responses(409),
)
async def register(
    name: NamePath,
    body: Annotated[dw.RegisterRequest, Depends(json_body(dw.RegisterRequest))],
    server: DataserverDep,
) -> Response:
    """Declare a consumer and its columns (idempotent; other columns under the same name are a 409)."""
    x = server.experience
    consumer = await x.call(
        x.store.register, name, needs=body.needs, produces=body.produces, dispatch_size=body.dispatch_size
    )
    return _json(dw.ConsumerBody.of(consumer))


@router.post(
    "/consumers/{name}/dispatch",
    response_model=dw.DispatchBody,
    openapi_extra=request_body(dw.DispatchRequest),
    responses=error_responses(404),
)
async def dispatch(
    name: NamePath,
    body: Annotated[dw.DispatchRequest, Depends(json_body(dw.DispatchRequest))],
    server: DataserverDep,
    request: Request,
) -> Response:
    """Claim rows ready for the consumer under a lease (empty, with ``lease: null``, when none is ready, at once
    or after ``wait_s`` without one)."""
    return await _long_poll(server, request, body.wait_s, partial(_dispatch, name=name, body=body))


async def _long_poll(
    server: Dataserver, request: Request, wait_s: float, look: Callable[[ExperienceStore], tuple[bool, bytes]]
) -> Response:
    """A dispatch's answer (see :func:`_when_ready`); an empty one is left out of the access log."""
    empty, answer = await _when_ready(server, wait_s, look)
    # An idle worker's dispatches, one every few seconds, would bury the requests that matter in the log.
    request.state.quiet = empty
    return Response(answer, media_type="application/json")


async def _when_ready(
    server: Dataserver,
    wait_s: float,
    look: Callable[[ExperienceStore], tuple[bool, bytes]],
    *,
    since: int | None = None,
) -> tuple[bool, bytes]:
    """A dispatch (``look``, which says whether it found no row, and its JSON), waiting up to ``wait_s`` for a
    ready row. With ``since`` (see :meth:`Rollouts.when_ready`), a look made already found none, and none is
    made again without waiting."""
    x = server.experience
    return await server.rollouts.when_ready(wait_s, lambda: x.call(look, x.store), since=since)


def _dispatch(experience: ExperienceStore, name: str, body: dw.DispatchRequest) -> tuple[bool, bytes]:
    """Whether the dispatch found no row, and its JSON. Never waits: the store's thread is every write's."""
    batch = experience.dispatch(
        name,
        body.count,
        iteration=body.iteration,
        groups=body.groups,
        dp_size=body.dp_size,
        balance_by=body.balance_by,
        max_tokens_per_microbatch=body.max_tokens_per_microbatch,
        lease_s=body.lease_s,
        cells=True,
    )
    return batch.lease is None, dw.dispatch_json(batch)


@router.post(
    "/consumers/{name}/dispatches",
    response_model=dw.DispatchesBody,
    openapi_extra=request_body(dw.DispatchManyRequest),
    responses=error_responses(404),
)
async def dispatch_many(
    name: NamePath,
    body: Annotated[dw.DispatchManyRequest, Depends(json_body(dw.DispatchManyRequest))],
    server: DataserverDep,
    request: Request,
) -> Response:
    """Claim up to ``count`` ready rows in all, from up to ``tables`` tables, the oldest first: a dispatch per
    table, each under a lease of its own (none when no row is ready, at once or after ``wait_s`` without one).
    A worker whose rows come one table at a time makes one request for several."""
    return await _long_poll(server, request, body.wait_s, partial(_dispatch_many, name=name, body=body))


def _dispatch_many(experience: ExperienceStore, name: str, body: dw.DispatchManyRequest) -> tuple[bool, bytes]:
    found = experience.dispatch_many(name, body.count, tables=body.tables, lease_s=body.lease_s, cells=True)
    return not found, dw.dispatches_json(found)


@router.post(
    "/consumers/{name}/collections",
    response_model=dw.CollectedManyBody,
    openapi_extra=request_body(dw.CollectManyRequest),
    responses=error_responses(404),
)
async def collect_many(
    name: NamePath,
    body: Annotated[dw.CollectManyRequest, Depends(json_body(dw.CollectManyRequest))],
    server: DataserverDep,
) -> Response:
    """Collect several of the consumer's leases in one transaction, as ``/leases/{lease}/collect`` collects one;
    a lease the store refuses (unknown, or expired: its rows went back to the pool) is answered with why, in its
    place, and the others are collected. With ``next``, then dispatch the consumer's next rows, as
    ``/dispatches`` would, answered in ``next``."""
    leases = [c.lease for c in body.collections]
    after = body.next
    if after is None:
        outcomes, _ = await server.rollouts.collect_many_wire(name, body)
        return Response(dw.collected_many_json(leases, outcomes), media_type="application/json")
    since = server.rollouts.written.version
    outcomes, first = await server.rollouts.collect_many_wire(name, body, lambda x, _: _dispatch_many(x, name, after))
    assert first is not None  # collect_many_wire answers what it was given to call
    dispatched = await _next(server, first, after.wait_s, partial(_dispatch_many, name=name, body=after), since)
    return Response(dw.collected_many_json(leases, outcomes, dispatched), media_type="application/json")


@router.get("/consumers/{name}/tables/{iteration}", response_model=dw.ConsumptionBody, responses=error_responses(404))
async def consumption(name: NamePath, iteration: IterationPath, server: DataserverDep) -> Response:
    """Where the consumer stands in the table: rows consumed, held and ready, and ``all_consumed``."""
    x = server.experience
    return _json(dw.ConsumptionBody.of(await x.call(x.store.consumption, name, iteration)))


@router.post(
    "/leases/{lease}/collect",
    response_model=dw.CollectedBody,
    openapi_extra=request_body(dw.CollectRequest),
    responses=error_responses(404, 409),
)
async def collect(
    lease: LeasePath,
    body: Annotated[dw.CollectRequest, Depends(json_body(dw.CollectRequest))],
    server: DataserverDep,
) -> Response:
    """Write the consumer's results for the leased rows and mark them consumed; an expired lease is a 409.

    The ``grader`` role's results are grades: they are stored and counted in the curriculum's statistics.
    With ``next``, then dispatch the consumer's next rows (once the collection is stored), answered in ``next``.
    """
    after = body.next
    if after is None:
        collected, _ = await server.rollouts.collect_wire(lease, body)
        return Response(dw.collected_json(collected, None), media_type="application/json")
    # The next dispatch's first look goes with the collection: one store call, one commit.
    since = server.rollouts.written.version
    collected, first = await server.rollouts.collect_wire(lease, body, lambda x, name: _dispatch(x, name, after))
    assert first is not None  # collect_wire answers what it was given to call
    look = partial(_dispatch, name=collected.consumer, body=after)
    dispatched = await _next(server, first, after.wait_s, look, since)
    return Response(dw.collected_json(collected, dispatched), media_type="application/json")


async def _next(
    server: Dataserver,
    first: tuple[bool, bytes],
    wait_s: float,
    look: Callable[[ExperienceStore], tuple[bool, bytes]],
    since: int,
) -> bytes:
    """A collection's next dispatch, as JSON: its first look's, made with the collection, or, when that found no
    row, a long poll of ``wait_s`` that waits for a write after ``since`` before it looks again."""
    if first[0] and wait_s > 0:
        first = await _when_ready(server, wait_s, look, since=since)
    return first[1]


@router.post(
    "/leases/{lease}/renew",
    response_model=dw.RenewBody,
    openapi_extra=request_body(dw.RenewRequest),
    responses=error_responses(409),
)
async def renew(
    lease: LeasePath,
    body: Annotated[dw.RenewRequest, Depends(json_body(dw.RenewRequest))],
    server: DataserverDep,
) -> Response:
    """Hold the lease's rows ``lease_s`` seconds more, from now."""
    x = server.experience
    return _json(dw.RenewBody(expires_at=await x.call(x.store.renew, lease, body.lease_s)))
