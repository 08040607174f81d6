"""The OpenAPI description, completed with what FastAPI cannot see on its own.

Request bodies are parsed by :func:`proctor.server.deps.json_body` rather than by FastAPI (see there why),
so their schemas are added here; and the bearer-token requirement, enforced by a middleware, is published
when the server has an API key. A client generated from ``/openapi.json`` then meets no status, body or
authentication it was not told about.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

__all__ = ["complete_openapi", "request_body"]

_REF = "#/components/schemas/{model}"
# Models named by `request_body`: FastAPI copies `openapi_extra` through its own models, so only the name goes
# into the operation, and the schema is looked up here.
_BODIES: dict[str, type[BaseModel]] = {}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` for a route whose JSON body is ``model``."""
    _BODIES[model.__name__] = model
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        },
        "x-proctor-body": model.__name__,  # replaced by the schema in complete_openapi
    }


def complete_openapi(
    app: FastAPI,
    *,
    bearer: bool,
    limits: dict[tuple[str, str], dict[str, int]] | None = None,
    open_paths: frozenset[str] = frozenset(),
) -> None:
    """Make ``app.openapi()`` include every request body's schema and, with ``bearer``, the API key.

    ``limits`` adds this server's configured bounds to the published schemas: ``{(model, field): {"maximum":
    4096}}``, so that the schema a client reads is the one this server enforces.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                name = operation.pop("x-proctor-body", None)
                if name is not None:
                    body = _BODIES[name].model_json_schema(ref_template=_REF)
                    schemas.update(body.pop("$defs", {}))
                    schemas[name] = body
                if bearer and path not in open_paths:
                    operation["security"] = [{"bearer": []}]
        for (model_name, field), bounds in (limits or {}).items():
            prop = schemas[model_name]["properties"][field]
            for option in prop.get("anyOf", [prop]):  # an optional field's bounds sit in its non-null branch
                if option.get("type") != "null":
                    option.update(bounds)
        if bearer:
            components["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "The server's PROCTOR_API_KEY."}
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
