"""Dependencies shared by the routes, as ``Annotated`` aliases."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from proctor.server.dataserver import Dataserver
from proctor.server.exceptions import RequestError
from proctor.server.handle import DataserverHandle
from proctor.server.metrics import Metrics

__all__ = ["DataserverDep", "MetricsDep", "json_body"]

M = TypeVar("M", bound=BaseModel)


# async, although they do not await: FastAPI runs plain `def` dependencies in a worker thread, which would
# cost three thread hops on every request.
async def _dataserver(request: Request) -> Dataserver:
    handle: DataserverHandle = request.state.dataserver
    return handle.get()


DataserverDep = Annotated[Dataserver, Depends(_dataserver)]


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.state.metrics
    return metrics


MetricsDep = Annotated[Metrics, Depends(_metrics)]


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency that reads the request body as ``model``, parsed by pydantic straight from the bytes.

    FastAPI's own body parsing (``json.loads``, then validation) costs about ten times as much on a body
    dense with small JSON values, all of it on the event loop: a hostile body of a few MiB held the loop
    for a second. Pair it with ``openapi_extra=request_body(model)`` so that the schema still shows it.
    """

    async def parse(request: Request) -> M:
        try:
            raw = await request.body()
        except ClientDisconnect:
            # Gone before its body arrived (or cut off by the body deadline): nobody is left to answer.
            raise RequestError("body: the client disconnected before sending it whole") from None
        try:
            # Strict: a number is a JSON number (``true`` or ``"5"`` is refused, not read as 1 or 5), whatever
            # the model, including the experience store's, whose client builds them from Python values.
            return model.model_validate_json(raw, strict=True)
        except ValidationError as exc:
            # Located under "body", as FastAPI's own errors are; the error handler turns them into a 400/422.
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None

    return parse
