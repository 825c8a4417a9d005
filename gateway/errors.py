"""Errors in OpenAI's shape, and the one place where typed errors become HTTP statuses.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`. Validation
errors are 400s in that shape (not FastAPI's 422 body) and nothing unexpected ever leaks a
stack trace: the request gate (gateway/middleware.py) logs it and answers a generic 500.
"""

from __future__ import annotations

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
    RequestFailed,
)
from engine.sampler import InvalidSampling


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

    @classmethod
    def internal(cls) -> APIError:
        return cls(500, "internal server error", "server_error")

    @classmethod
    def shutting_down(cls) -> APIError:
        return cls(503, "the server is shutting down", "server_error", code="shutting_down")

    @classmethod
    def timeout(cls) -> APIError:
        return cls(504, "the request timed out", "server_error", code="timeout")

    @classmethod
    def too_large(cls, max_bytes: int) -> APIError:
        return cls(413, f"the request body is larger than {max_bytes} bytes",
                   code="request_too_large")  # fmt: skip


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
    if isinstance(error, RequestFailed):  # this request alone; the others went on
        return APIError(500, str(error), "server_error", code="request_failed")
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), "server_error", None, "shutting_down")
    return APIError(500, "the request failed inside the engine", "server_error")


def respond_with(request: Request, error: APIError) -> JSONResponse:
    """The error's response; the request's settlement reads `api_error` for its audit event."""
    if getattr(request.state, "api_error", None) is None:
        request.state.api_error = error
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    """Routes' errors become OpenAI-shaped responses (the request gate contains the rest)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return respond_with(request, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return respond_with(request, validation_to_api_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        status = error.status_code
        return respond_with(
            request, APIError(status, str(error.detail), kinds.get(status, "server_error"))
        )


def validation_to_api_error(errors: Any) -> APIError:
    """The first validation problem, with the offending field as `param`."""
    first = next(iter(errors), None) or {"loc": (), "msg": "invalid request"}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # `param` names the top-level field, as OpenAI does; the message keeps the full path.
    param = location[0] if location else None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "missing" and not location:
        message = "the request needs a JSON body"
    elif first.get("type") == "extra_forbidden":
        message = f"unsupported parameter: {'.'.join(location)}"
    elif first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif location:
        message = f"{'.'.join(location)}: {message}"
    return invalid(message, param)
