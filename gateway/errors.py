"""Errors in OpenAI's shape, and the one place where typed errors become HTTP statuses.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`. Validation
errors are 400s in that shape (not FastAPI's 422 body) and nothing unexpected ever leaks a
stack trace: the request gate (gateway/http/middleware.py) logs it and answers a generic 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    CacheQuotaTimeout,
    ContextTooLong,
    EngineError,
    EngineOverloaded,
    EngineRestarted,
    EngineStopped,
    ExceedsCacheQuota,
    InvalidRequest,
    PoolTimeout,
    RequestFailed,
    TenantDeleted,
)
from engine.sampling.sampler import InvalidSampling
from tenancy.api_keys import AuthFailure
from tenancy.db import is_outage
from tenancy.errors import Conflict, InvalidInput, NotFound, TenancyError


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error a client sees, as the OpenAPI spec shows it (`APIError.body` writes it)."""

    error: ErrorDetail


class APIError(Exception):
    """An error to send to the client as it is; build one with a named constructor below."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = {} if retry_after is None else {"Retry-After": str(retry_after)}

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

    # 4xx: the client can change something

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        """400: the request is wrong; `param` names the field."""
        return cls(400, message, param=param, code=code)

    @classmethod
    def not_json(cls) -> APIError:
        """400: the body does not parse as JSON (bad syntax, bytes that are not UTF-8, nesting
        or a number too large for the parser)."""
        return cls.invalid("the request body is not valid JSON")

    @classmethod
    def unauthorized(cls, message: str) -> APIError:
        """401: no key, or not a valid one."""
        return cls(401, message, error_type="authentication_error", code="invalid_api_key")

    @classmethod
    def tenant_suspended(cls) -> APIError:
        """403: a valid key of a suspended (or deleted) tenant."""
        message = "this tenant is suspended"
        return cls(403, message, error_type="permission_error", code="tenant_suspended")

    @classmethod
    def admin_unauthorized(cls, message: str) -> APIError:
        """401: an admin call without a valid session token or tenant-admin key."""
        return cls(401, message, error_type="authentication_error", code="invalid_admin_token")

    @classmethod
    def forbidden(cls, message: str) -> APIError:
        """403: the caller is known but may not do this."""
        return cls(403, message, error_type="permission_error", code="forbidden")

    @classmethod
    def login_failed(cls) -> APIError:
        """401: an operator login whose name, password or one-time code is wrong. One answer
        for all three (and for unknown names), so that it confirms nothing."""
        message = "wrong username, password or one-time code"
        return cls(401, message, error_type="authentication_error", code="invalid_credentials")

    @classmethod
    def second_factor_required(cls, username: str) -> APIError:
        """403: an admin with the right password but no second factor, where one is required."""
        message = (
            "this admin account needs a TOTP second factor before it can log in: on the "
            f"gateway's host, run `prefixgate admins enrol-totp {username}`"
        )
        return cls(403, message, error_type="permission_error", code="second_factor_required")

    @classmethod
    def not_found(cls, message: str) -> APIError:
        """404: no such resource (or none this caller may see)."""
        return cls(404, message, error_type="not_found_error", code="not_found")

    @classmethod
    def conflict(cls, message: str) -> APIError:
        """409: the change contradicts what exists (a duplicate, the last admin)."""
        return cls(409, message, code="conflict")

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        """404: a model this gateway does not serve."""
        message = f"the model {model!r} does not exist"
        return cls(
            404, message, error_type="not_found_error", param="model", code="model_not_found"
        )

    @classmethod
    def body_stalled(cls, timeout_s: float) -> APIError:
        """408: no body bytes for `timeout_s` while the server was reading."""
        message = f"the request body stalled: no bytes for {timeout_s:g} s"
        return cls(408, message, code="request_timeout")

    @classmethod
    def too_large(cls, max_bytes: int) -> APIError:
        """413: a request body past `max_bytes`."""
        message = f"the request body is larger than {max_bytes} bytes"
        return cls(413, message, code="request_too_large")

    @classmethod
    def rate_limited(
        cls,
        message: str,
        retry_after: int,
        code: str = "rate_limit_exceeded",
        param: str | None = None,
    ) -> APIError:
        """429: a limit of the tenant's; it may retry after `retry_after` seconds."""
        return cls(
            429,
            message,
            error_type="rate_limit_error",
            param=param,
            code=code,
            retry_after=retry_after,
        )

    @classmethod
    def headers_too_large(cls, max_bytes: int) -> APIError:
        """431: request headers past `max_bytes`."""
        message = f"request headers are larger than {max_bytes} bytes"
        return cls(431, message, code="headers_too_large")

    # 5xx: the server cannot serve it now

    @classmethod
    def internal(cls, message: str = "internal server error", code: str | None = None) -> APIError:
        """500: something failed on our side; the message never holds a stack trace."""
        return cls(500, message, error_type="server_error", code=code)

    @classmethod
    def overloaded(cls, message: str, retry_after: int) -> APIError:
        """503: too much work right now; retry after `retry_after` seconds."""
        return cls(
            503, message, error_type="server_error", code="overloaded", retry_after=retry_after
        )

    @classmethod
    def auth_unavailable(cls) -> APIError:
        """503: keys cannot be checked (the database is away and the key is not remembered)."""
        message = "authentication is unavailable; retry shortly"
        return cls(503, message, error_type="server_error", code="auth_unavailable", retry_after=5)

    @classmethod
    def shutting_down(cls, message: str = "the server is shutting down") -> APIError:
        """503: the server (or its engine) is stopping."""
        return cls(503, message, error_type="server_error", code="shutting_down")

    @classmethod
    def database_unavailable(cls) -> APIError:
        """503: the database is unreachable or busy; nothing was changed."""
        message = "the database is unavailable; retry shortly"
        return cls(
            503, message, error_type="server_error", code="database_unavailable", retry_after=2
        )

    @classmethod
    def timeout(cls) -> APIError:
        """504: the request ran past `request_timeout_s`."""
        return cls(504, "the request timed out", error_type="server_error", code="timeout")


def from_engine_error(error: EngineError | InvalidSampling) -> APIError:
    """The HTTP form of an engine error."""
    if isinstance(error, InvalidSampling):
        return APIError.invalid(str(error), error.param)
    if isinstance(error, ContextTooLong):
        return APIError.invalid(str(error), "messages", "context_length_exceeded")
    if isinstance(error, InvalidRequest):
        return APIError.invalid(str(error), error.param)
    if isinstance(error, CacheQuotaTimeout):
        return APIError.rate_limited(str(error), retry_after=5, code="cache_quota_exceeded")
    if isinstance(error, PoolTimeout | EngineOverloaded):
        return APIError.overloaded(str(error), retry_after=5)
    if isinstance(error, EngineRestarted):
        return APIError.overloaded(str(error), retry_after=1)
    if isinstance(error, RequestFailed):  # this request alone; the others went on
        return APIError.internal(str(error), code="request_failed")
    if isinstance(error, EngineStopped):
        return APIError.shutting_down(str(error))
    if isinstance(error, TenantDeleted):  # the answer the deleted tenant's key gets too
        return APIError.tenant_suspended()
    return APIError.internal("the request failed inside the engine")


def engine_failure(error: Exception, tenant_slug: str, prompt_param: str) -> APIError:
    """The client's error for an exception from the engine while it served a request.

    `prompt_param` is the request's name for its prompt ("messages" or "prompt").
    """
    if isinstance(error, ExceedsCacheQuota):  # say it in the tenant's terms, not its id
        param = error.param if error.param != "messages" else prompt_param
        return APIError.invalid(f"tenant {tenant_slug}: {error}", param, "cache_quota_too_small")
    if isinstance(error, EngineError | InvalidSampling):
        api_error = from_engine_error(error)
        if api_error.param == "messages":  # the engine's name for the prompt
            api_error.param = prompt_param
        return api_error
    return APIError.internal()


def from_auth_failure(failure: AuthFailure) -> APIError:
    """The HTTP form of a refused key: a suspended tenant is told so, other refusals look alike."""
    if failure in (AuthFailure.TENANT_SUSPENDED, AuthFailure.TENANT_DELETED):
        return APIError.tenant_suspended()
    return APIError.unauthorized("invalid API key")


def from_tenancy_error(error: TenancyError) -> APIError:
    """The HTTP form of a refused tenancy change."""
    if isinstance(error, NotFound):
        return APIError.not_found(str(error))
    if isinstance(error, Conflict):
        return APIError.conflict(str(error))
    param = error.field if isinstance(error, InvalidInput) else None
    return APIError.invalid(str(error), param)


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

    @app.exception_handler(OperationalError)
    async def database_error(request: Request, error: OperationalError) -> JSONResponse:
        if not is_outage(error):
            raise error  # a bug, not an outage: the request gate answers 500 and logs it
        return respond_with(request, APIError.database_unavailable())

    @app.exception_handler(TenancyError)
    async def tenancy_error(request: Request, error: TenancyError) -> JSONResponse:
        return respond_with(request, from_tenancy_error(error))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return respond_with(request, validation_to_api_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return respond_with(request, from_http_exception(error))


def from_http_exception(error: StarletteHTTPException) -> APIError:
    """The OpenAI form of Starlette's and FastAPI's own errors.

    FastAPI answers a body that Python's JSON parser gives up on (nesting past the recursion
    limit, a number of thousands of digits, bytes that are not UTF-8) with a bare 400 of its
    own: it is the same mistake as a syntax error, and gets the same answer.
    """
    status = error.status_code
    if status == 400 and isinstance(error.__cause__, ValueError | RecursionError):
        return APIError.not_json()
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    return APIError(status, str(error.detail), error_type=kinds.get(status, "server_error"))


def validation_to_api_error(errors: Any) -> APIError:
    """The most telling problem with the first bad field, with that field as `param`.

    A field that may take several shapes (a prompt is a string or token ids) fails once per
    shape; the error that got furthest into the value (`prompt.0: >= 0`) says more than "not a
    string". Pydantic's names for the shapes (`list[int]`, `function-after[...]`) are left out.
    """
    errors = list(errors) or [{"loc": (), "msg": "invalid request"}]
    field = _location(errors[0])[:1]
    candidates = [error for error in errors if _location(error)[:1] == field]
    first = min(candidates, key=_specificity)
    if tuple(first.get("loc", ()))[:1] == ("header",):  # a header keeps its own name
        location = [str(part) for part in _location(first)]
    else:
        parts = (_plain(part) for part in _location(first))
        location = [part for part in parts if part is not None]
    # `param` names the top-level field, as OpenAI does; the message keeps the full path.
    param = location[0] if location else None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "missing" and not location:
        message = "the request needs a JSON body"
    elif first.get("type") == "extra_forbidden":
        message = f"unsupported parameter: {'.'.join(location)}"
    elif first.get("type") == "json_invalid":
        return APIError.not_json()
    elif location:
        message = f"{'.'.join(location)}: {message}"
    return APIError.invalid(message, param)


_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})


def _location(error: Any) -> tuple[Any, ...]:
    """Where in the request the error is, without FastAPI's leading body/query/path part."""
    location = tuple(error.get("loc", ()))
    return location[1:] if location[:1] and location[0] in _SOURCES else location


def _specificity(error: Any) -> tuple[bool, int]:
    """Sort key: errors about a value before errors about its type, deeper ones first."""
    return str(error.get("type", "")).endswith("_type"), -len(error.get("loc", ()))


def _plain(part: Any) -> str | None:
    """A location part a client would recognise (a field or an index), else None."""
    text = str(part)
    return text if isinstance(part, int) or (text.isidentifier() and text not in _SHAPES) else None


_SHAPES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
