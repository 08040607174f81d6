"""Dependencies shared by the routes, as ``Annotated`` aliases."""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import ClientDisconnect

from proctor.server.dataserver import Dataserver
from proctor.server.exceptions import RequestError
from proctor.server.handle import DataserverHandle, Grading
from proctor.server.metrics import Metrics

__all__ = ["DataserverDep", "GradingDep", "MetricsDep", "json_body"]

M = TypeVar("M", bound=BaseModel)


# async, although they do not await: FastAPI runs plain `def` dependencies in a worker thread, which would
# cost three thread hops on every request.
async def _dataserver(request: Request) -> Dataserver:
    handle: DataserverHandle = request.state.dataserver
    return handle.get()


DataserverDep = Annotated[Dataserver, Depends(_dataserver)]


async def _grading(request: Request) -> Grading:
    handle: DataserverHandle = request.state.dataserver
    return handle.grading()


GradingDep = Annotated[Grading, Depends(_grading)]


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
            errors = [
                {**e, "loc": ("body", *e["loc"])} for e in _unknown_fields_named(model, exc.errors(include_url=False))
            ]
            raise RequestValidationError(errors) from None

    return parse


def _unknown_fields_named(model: type[BaseModel], errors: Sequence[ErrorDetails]) -> Sequence[ErrorDetails]:
    """``errors``, or, where the body has fields its model does not know, one error per object that has them,
    naming them and the object's own fields: a typo (``bacth``) says so, rather than that a field is missing.
    Checked here, after the parse, rather than by a validator on the model, which would make pydantic build
    every object of a body as a Python dict before validating it (most of a 64-item /grade's parse)."""
    unknown: dict[tuple[int | str, ...], list[str]] = {}
    for e in errors:
        if e["type"] == "extra_forbidden":
            unknown.setdefault(tuple(e["loc"][:-1]), []).append(str(e["loc"][-1]))
    if not unknown:
        return errors
    named: list[ErrorDetails] = []
    for where, keys in unknown.items():
        shown = ", ".join(repr(k[:40]) for k in keys[:3]) + (", …" if len(keys) > 3 else "")
        message = f"unknown field{'s' if len(keys) > 1 else ''} {shown}"
        fields = _fields_at(model, where)
        if fields:
            message += f"; the fields are {', '.join(fields)}"
        named.append({"type": "value_error", "loc": where, "msg": message, "input": None})
    return named


def _fields_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The fields of the object at ``loc`` in a body of ``model`` (none where that is not a model)."""
    kind: Any = model
    for part in loc:
        kind = _bare(kind)
        if isinstance(part, int) and get_origin(kind) is list:
            kind = get_args(kind)[0]
        elif isinstance(part, str) and isinstance(kind, type) and issubclass(kind, BaseModel):
            field = kind.model_fields.get(part)
            if field is None:
                return []
            kind = field.annotation
        else:
            return []
    kind = _bare(kind)
    return list(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else []


def _bare(kind: Any) -> Any:
    """``kind`` without ``Annotated`` and without ``| None``."""
    while True:
        origin = get_origin(kind)
        if origin is Annotated:
            kind = get_args(kind)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in get_args(kind) if a is not type(None)]
            if len(rest) != 1:
                return kind
            kind = rest[0]
        else:
            return kind
