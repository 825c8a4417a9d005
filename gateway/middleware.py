"""The ASGI layers every request passes before a route: the request gate and the body limit.

`RequestGate` is outermost. For every HTTP request it turns an exception that escaped a route
into a 500 in OpenAI's error shape *without* re-raising it, so the client's keep-alive
connection stays usable. Under /v1 it also opens the request's `Settlement`, checks the API key
from the headers before a byte of the body is read (a bad key never costs a body read), and
settles the request exactly once when it ends, whatever the outcome.

`BodySizeLimit` rejects bodies over the limit with a 413 without reading them whole.
"""

from __future__ import annotations

import logging
import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import AuthenticationFailed, Principal
from gateway.errors import APIError
from gateway.settlement import Settlement, settle
from gateway.state import GatewayState

logger = logging.getLogger(__name__)


class RequestGate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # When the request arrived, for the Server-Timing header of the response.
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        path: str = scope["path"]
        settlement = None
        if path == "/v1" or path.startswith("/v1/"):
            settlement = Settlement.for_request(scope["method"], path, client_ip(scope))
            scope["state"]["settlement"] = settlement
        started = False

        state: GatewayState = scope["app"].state.gateway

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if settlement is not None:
                    settlement.status = message["status"]
            elif settlement is not None and not message.get("more_body", False):
                # Settled before the last byte leaves: whoever saw the response can find
                # its audit event queued.
                settlement.note_error_from(scope["state"])
                settle(state, settlement)
            await send(message)

        try:
            if settlement is not None:
                principal = await _authenticate(state, settlement, Headers(scope=scope))
                settlement.principal = scope["state"]["principal"] = principal
            await self.app(scope, receive, tracking_send)
        except APIError as error:  # refused at the gate (bad key, draining)
            if settlement is not None:
                settlement.note_error(error)
            if not started:
                await error.response()(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], path)
            if started:  # the response is cut short: only closing the connection says so
                raise
            internal = APIError.internal()
            if settlement is not None:
                settlement.note_error(internal)
            await internal.response()(scope, receive, tracking_send)
        finally:
            if settlement is not None:
                settlement.note_error_from(scope["state"])
                settle(state, settlement)


async def _authenticate(state: GatewayState, settlement: Settlement, headers: Headers) -> Principal:
    """The tenant behind the bearer key, from the headers alone; 401/403/503 otherwise."""
    if state.draining:
        raise APIError.shutting_down()
    scheme, _, presented = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        settlement.auth_failure = "missing_key"
        raise APIError(401, "missing API key: send Authorization: Bearer <key>",
                       "authentication_error", None, "invalid_api_key")  # fmt: skip
    with state.tracer.start_as_current_span("auth"):
        try:
            principal = await state.auth.authenticate(presented.strip())
        except AuthenticationFailed as failure:
            settlement.auth_failure = failure.failure.value
            settlement.key_id = failure.key_id
            raise
    state.tenant_names[principal.tenant_id] = principal.tenant_slug
    return principal


def client_ip(scope: Scope) -> str | None:
    """The peer's address (a trusted proxy's X-Forwarded-For is applied by the server)."""
    client = scope.get("client")
    return str(client[0]) if client else None


class BodySizeLimit:
    """Reads the body (at most `max_bytes`) before the app does; a larger one is a 413.

    Reading it here, after the gate has checked the key, means a declared or chunked body over
    the limit is refused the same way, and the app sees one complete body message.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError.too_large(self.max_bytes).response()
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        if message["type"] != "http.request":
            body = message
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return body
            return await receive()

        await self.app(scope, replay, send)
