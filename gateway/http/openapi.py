"""The OpenAPI spec says what the API really answers: OpenAI-shaped errors, never a 422.

FastAPI documents a 422 validation body on every route with parameters; PrefixGate answers
validation errors with a 400 in OpenAI's error shape instead, so the spec is rewritten to match,
and each route lists the error statuses it can return.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.errors import ErrorResponse


def error_response(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# Every /v1 route passes the request gate: a key check, the body limit and a catch-all.
API_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: error_response("Invalid request (the `param` names the field)"),
    401: error_response("Missing or invalid API key"),
    403: error_response("The tenant is suspended"),
    404: error_response("No such model or route"),
    408: error_response("The request body stalled"),
    413: error_response("The request body is too large"),
    429: error_response("A per-tenant limit was reached (see Retry-After)"),
    500: error_response("Internal error"),
    503: error_response("Overloaded, shutting down or authentication unavailable"),
}
INFERENCE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **API_RESPONSES,
    200: {
        "description": "A completion, or with `stream: true` server-sent events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    504: error_response("The request timed out"),
}

# Every /admin/api route: a bearer session token (or tenant-admin key), JSON in and out.
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: error_response("Invalid request (the `param` names the field)"),
    401: error_response("Missing, expired, wrongly signed or revoked admin token"),
    403: error_response("The caller may not do this (a tenant-admin, an inference key)"),
    404: error_response("No such resource, or none this caller may see"),
    409: error_response("Conflicts with what exists"),
    413: error_response("The request body is too large"),
    500: error_response("Internal error"),
}


_REF = "#/components/schemas/{model}"
# Models of request bodies that routes parse themselves (off the event loop), by name.
_BODY_MODELS: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that parses a JSON body of `model` itself."""
    _BODY_MODELS[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Serve a spec without FastAPI's 422 responses and validation-error schemas, with the
    schemas of the bodies that routes parse themselves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            for name, model in _BODY_MODELS.items():
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[name] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
