"""Errors in OpenAI's shape, and the one place where typed errors become HTTP statuses.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`. Validation
errors are 400s in that shape (not FastAPI's 422 body) and nothing unexpected ever leaks a
stack trace: it is logged and answered with a generic 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    CacheQuotaTimeout,
    ContextTooLong,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    InvalidRequest,
    PoolTimeout,
)
from engine.sampler import InvalidSampling

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send to the client as it is."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_engine_error(error: EngineError | InvalidSampling) -> APIError:
    """The HTTP form of an engine error."""
    if isinstance(error, InvalidSampling):
        return invalid(str(error), error.param)
    if isinstance(error, ContextTooLong):
        return invalid(str(error), "messages", "context_length_exceeded")
    if isinstance(error, InvalidRequest):
        return invalid(str(error), error.param)
    if isinstance(error, CacheQuotaTimeout):
        return APIError(
            429, str(error), "rate_limit_error", None, "cache_quota_exceeded", {"Retry-After": "5"}
        )
    if isinstance(error, PoolTimeout | EngineOverloaded):
        return APIError(503, str(error), "server_error", None, "overloaded", {"Retry-After": "5"})
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), "server_error", None, "shutting_down")
    return APIError(500, "the request failed inside the engine", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_to_api_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        return APIError(
            error.status_code, str(error.detail), kinds.get(error.status_code, "server_error")
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, "internal server error", "server_error").response()


def validation_to_api_error(errors: Any) -> APIError:
    """The first validation problem, with the offending field as `param`."""
    first = next(iter(errors), None) or {"loc": (), "msg": "invalid request"}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # `param` names the top-level field, as OpenAI does; the message keeps the full path.
    param = location[0] if location else None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "extra_forbidden":
        message = f"unsupported parameter: {'.'.join(location)}"
    elif first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif location:
        message = f"{'.'.join(location)}: {message}"
    return invalid(message, param)
