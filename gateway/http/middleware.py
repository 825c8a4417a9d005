"""The ASGI layers every request passes before a route: the request gate and the body limit.

`RequestGate` is outermost. For every HTTP request it turns an exception that escaped a route
into a 500 in OpenAI's error shape *without* re-raising it, so the client's keep-alive
connection stays usable. Under /v1 it also opens the request's `Settlement`, checks the API key
from the headers before a byte of the body is read (a bad key never costs a body read), admits
an inference request against its tenant's limits, and settles the request exactly once when it
ends, whatever the outcome.

The gate also logs, once, when requests come through a proxy that `trusted_proxies` does not
name (`warn_of_untrusted_proxy`).

`BodySizeLimit` reads the body within its size limit and deadline before any route runs.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth.key_auth import AuthenticationFailed, Caller
from gateway.errors import APIError, from_auth_failure
from gateway.http.connections import trusted_proxy_networks
from gateway.http.deps import single_header
from gateway.http.settlement import Settlement, settle
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
        state: GatewayState = scope["app"].state.gateway
        if not state.untrusted_proxy_warned:
            warn_of_untrusted_proxy(state, scope)
        if path == "/v1" or path.startswith("/v1/"):
            settlement = Settlement.for_request(scope["method"], path, client_ip(scope))
            scope["state"]["settlement"] = settlement
        started = False
        request_id = f"req_{uuid.uuid4().hex}"

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = _response_headers(state, scope, settlement, request_id)
                message = {**message, "headers": [*message.get("headers", []), *extra]}
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
                headers = Headers(scope=scope)
                settlement.caller = await _authenticate(state, settlement, headers)
                _note_client_request_id(settlement, headers)
                # An inference request takes the tenant's concurrency slot before its body is
                # read: one key's slow uploads hold at most its own share of the server. Other
                # routes under /v1 (the model list) hold nothing while they run: they take one
                # request of the tenant's window and no slot.
                settlement.admission = state.limiter.admission(settlement.caller)
                if settlement.endpoint in INFERENCE_ENDPOINTS:
                    await settlement.admission.enter()
                else:
                    await settlement.admission.count()
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
                # A response the connection layer sent itself (a stalled body's 408).
                settlement.status = settlement.status or scope["state"].get("status_sent")
                settle(state, settlement)


INFERENCE_ENDPOINTS = frozenset({"chat", "completions"})
MAX_CLIENT_REQUEST_ID = 512


def _response_headers(
    state: GatewayState, scope: Scope, settlement: Settlement | None, request_id: str
) -> list[tuple[bytes, bytes]]:
    """`x-request-id` on every response; under /v1 also `openai-processing-ms` and, once the
    key is known, OpenAI's rate-limit headers from the tenant's own windows."""
    if settlement is None:
        return [(b"x-request-id", request_id.encode())]
    # The id the client sees is the one its audit event records: the completion's own id
    # once there is one, else this request's.
    settlement.request_id = settlement.request_id or request_id
    elapsed_ms = round((time.perf_counter() - scope["state"]["arrived"]) * 1000)
    headers = [
        (b"x-request-id", settlement.request_id.encode()),
        (b"openai-processing-ms", str(elapsed_ms).encode()),
    ]
    if settlement.admission is not None:
        headers += settlement.admission.headers()
    return headers


def _note_client_request_id(settlement: Settlement, headers: Headers) -> None:
    """The client's own id for the request (`X-Client-Request-Id`), kept in its audit event."""
    given = headers.get("x-client-request-id")
    if given is None:
        return
    if not (0 < len(given) <= MAX_CLIENT_REQUEST_ID and given.isascii() and given.isprintable()):
        message = (
            f"X-Client-Request-Id must be 1 to {MAX_CLIENT_REQUEST_ID} printable ASCII characters"
        )
        raise APIError.invalid(message, "X-Client-Request-Id")
    settlement.details["client_request_id"] = given


async def _authenticate(state: GatewayState, settlement: Settlement, headers: Headers) -> Caller:
    """The tenant behind the bearer key, from the headers alone; 401/403/503 otherwise."""
    if state.draining:
        raise APIError.shutting_down()
    scheme, _, presented = (single_header(headers, "Authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        settlement.auth_failure = "missing_key"
        raise APIError.unauthorized("missing API key: send Authorization: Bearer <key>")
    with state.tracer.start_as_current_span("auth"):
        try:
            caller = await state.auth.authenticate(presented.strip())
        except AuthenticationFailed as refused:
            settlement.auth_failure = refused.failure.value
            settlement.key_id = refused.key_id
            raise from_auth_failure(refused.failure) from refused
    if caller.role != "inference":  # least privilege: an admin credential does not infer
        settlement.auth_failure = "not_an_inference_key"
        settlement.key_id = caller.key_id
        raise APIError.forbidden(
            "this is a tenant-admin key: it manages its tenant under /admin/api; "
            "use an inference key here"
        )
    state.tenant_names[caller.tenant_id] = caller.tenant_slug
    return caller


def client_ip(scope: Scope) -> str | None:
    """The peer's address (a trusted proxy's X-Forwarded-For is applied by the server)."""
    client = scope.get("client")
    return str(client[0]) if client else None


_FORWARDING_HEADERS = (b"x-forwarded-for", b"forwarded")


def warn_of_untrusted_proxy(state: GatewayState, scope: Scope) -> None:
    """Log once per gateway when a request carries X-Forwarded-For or Forwarded from a peer
    that is not one of `trusted_proxies`: a proxy in front of the gateway that is not trusted
    makes every client behind it one address (one login throttle, one audit source)."""
    forwarded = [value for name, value in scope["headers"] if name in _FORWARDING_HEADERS]
    if not forwarded:
        return
    peer = client_ip(scope)
    networks = _networks(tuple(state.settings.trusted_proxies))
    if networks and peer is not None:
        # uvicorn has already replaced a trusted proxy's address by its client's, one taken
        # from X-Forwarded-For; an untrusted peer keeps its own address.
        listed = {
            part.strip() for value in forwarded for part in value.decode("latin-1").split(",")
        }
        if peer in listed or _within(peer, networks):
            return
    state.untrusted_proxy_warned = True
    logger.warning(
        "the gateway is reached through a proxy that is not trusted (a request from %s "
        "carried X-Forwarded-For or Forwarded): set PREFIXGATE_TRUSTED_PROXIES to the proxy's "
        "address or network, else every client behind it is seen as that one address (one "
        "login throttle, one source in the audit log) and the forwarded address is ignored",
        peer or "an unknown address",
    )


@functools.lru_cache(maxsize=8)
def _networks(entries: tuple[str, ...]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The trusted proxies as networks (parsed once: behind a trusted proxy every request asks)."""
    return [ipaddress.ip_network(network) for network in trusted_proxy_networks(list(entries))]


def _within(address: str, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(parsed in network for network in networks)


class BodySizeLimit:
    """Reads the body before the app does: at most `max_bytes` (else 413), within
    `deadline_s` in all (else 408 and the connection closes).

    Reading it here, after the gate has checked the key and taken the tenant's concurrency
    slot, means a declared or chunked body over the limit is refused the same way, a client
    dripping a byte at a time cannot hold a request open, and the app sees one complete body.
    A client that leaves mid-body is not served at all.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, deadline_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _refuse(APIError.too_large(self.max_bytes), scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.deadline_s):
                body = await self._read(receive)
        except TimeoutError:
            await _refuse(APIError.body_stalled(self.deadline_s), scope, receive, send)
            return
        except _TooLarge:
            await _refuse(APIError.too_large(self.max_bytes), scope, receive, send)
            return
        if body is None:  # the client left (or the server cut a stalled body): serve nothing
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnected first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer before the body was read, and close: the rest of it is never read."""
    scope.setdefault("state", {}).setdefault("api_error", error)  # for the audit event
    response = error.response()
    response.headers["connection"] = "close"
    await response(scope, receive, send)


class _TooLarge(Exception):
    """The body grew past the limit while being read."""
