"""How the gateway accepts HTTP connections: slow or unauthenticated clients cannot hold it.

`uvicorn_config` builds the uvicorn `Config` the gateway runs with. Its protocol is uvicorn's
own httptools protocol plus bounds on what a client can hold before it has sent a request:

- awaiting headers: from connection open (and, on a keep-alive connection, from the first byte
  of each later request) a client has `header_read_timeout_s` to finish its headers, however
  slowly it trickles them, and at most `MAX_HEADER_BYTES`; the connection counts as *pending*.
  A new connection past `max_pending_connections` pending ones is answered 503 and closed.
- awaiting body: headers done, body incomplete. With no body byte for `body_read_timeout_s`
  while we are reading, the request is abandoned: 408 if no response has started, then close.
  While we are not reading (the app has not caught up, or a pipelined request waits its turn)
  the client is not the one stalling, and its clock restarts when reading resumes.
- served or idle: uvicorn's own rules (keep-alive timeout after a response) apply.

A request the HTTP parser refuses (a malformed request line or header, a bad chunk, a
conflicting Content-Length) is answered in OpenAI's error shape, a JSON 400 coded
`invalid_http_request` with `Connection: close`, instead of uvicorn's plain-text one, wherever
an answer can still be placed on the connection. Where it cannot, the connection just closes:
when a response to an earlier request on it is still being sent (pipelining: the earlier
answers are finished first), or when the request's own response has already started (a body
that breaks after the app answered). Such requests never reach the app, so they leave no
audit event; a bad chunk in a body the app was reading is audited as that request's 400.

`X-Forwarded-For` is believed only from `trusted_proxies`; with none, it is ignored.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
import time
from asyncio import TimerHandle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httptools
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import APIError
from gateway.settings import Settings

logger = logging.getLogger(__name__)

# Request line plus headers; generous for real clients (uvicorn's h11 allows 16 KiB).
MAX_HEADER_BYTES = 64 * 1024
# The settings that decide what a connection may hold; callers cannot override them.
_GUARDED_OPTIONS = frozenset({"http", "ws", "proxy_headers", "forwarded_allow_ips"})


class InvalidTrustedProxy(ValueError):
    """A `trusted_proxies` entry that is neither an IP address nor a CIDR network."""


class RateLimitedLog:
    """A warning written at most once per interval, with a count of the ones left out."""

    def __init__(
        self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.suppressed = 0
        self._last_at: float | None = None

    def warning(self, message: str, *args: object) -> None:
        now = self.clock()
        if self._last_at is not None and now - self._last_at < self.interval_s:
            self.suppressed += 1
            return
        if self.suppressed:
            message += f" ({self.suppressed} more since the last such line)"
        logger.warning(message, *args)
        self._last_at, self.suppressed = now, 0


@dataclass(slots=True)
class ConnectionGuard:
    """The limits of one server and the count of its connections still sending headers."""

    header_read_timeout_s: float
    body_read_timeout_s: float
    max_pending_connections: int
    max_header_bytes: int = MAX_HEADER_BYTES
    pending: int = 0
    refusals: RateLimitedLog = field(default_factory=RateLimitedLog)
    slow_headers: RateLimitedLog = field(default_factory=RateLimitedLog)
    stalled_bodies: RateLimitedLog = field(default_factory=RateLimitedLog)

    def admit(self) -> bool:
        """Count a new connection as pending, unless the pending ones are at the limit."""
        if self.pending >= self.max_pending_connections:
            return False
        self.pending += 1
        return True


class _ResumableFlow(FlowControl):
    """uvicorn's flow control, telling the protocol when it starts reading again."""

    def __init__(self, transport: asyncio.Transport, on_resume: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_resume = on_resume

    def resume_reading(self) -> None:
        was_paused = self.read_paused
        super().resume_reading()
        if was_paused:
            self._on_resume()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body read deadlines and a pending bound."""

    guard: ClassVar[ConnectionGuard]  # set on the per-server subclass `uvicorn_config` makes

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._pending = False  # counted in guard.pending: awaiting a request's headers
        self._awaiting_body = False
        self._header_bytes = 0
        self._header_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._body_progress_at = 0.0
        self._unreadable = False  # the parser refused a request: nothing more is read

    @property
    def _peer(self) -> str:
        return self.client[0] if self.client else "?"

    # Connection lifecycle

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit():
            self.guard.refusals.warning(
                "refused a connection from %s: %d connections are still sending headers",
                self._peer,
                self.guard.pending,
            )
            message = "too many connections are waiting to send a request; retry shortly"
            self._answer_and_close(APIError.overloaded(message, retry_after=1))
            return
        self._pending = True
        self.flow = _ResumableFlow(transport, self._reading_resumed)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting_for_headers()
        self._stop_waiting_for_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._unreadable:  # a parser in its error state would only refuse again
            return
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self._pending and not self._awaiting_body:
            # Bytes on an idle keep-alive connection begin the next request, even bytes the
            # parser skips (blank lines between requests never reach on_message_begin).
            self._start_waiting_for_headers()
        # The parser gets no more header bytes than the cap leaves, so headers that arrive in
        # one read are bounded as surely as headers that trickle in, and a body that shares
        # the read is not counted. A request that begins inside a piece (pipelined behind
        # another) is counted from the next piece, so pieces are never larger than the cap.
        cap = self.guard.max_header_bytes
        while data:
            if self._pending:
                allowance = cap - self._header_bytes
                if allowance <= 0:
                    self._stop_waiting_for_headers()
                    self._give_up_on_headers(APIError.headers_too_large(cap))
                    return
                piece, data = data[:allowance], data[allowance:]
                self._header_bytes += len(piece)
            else:
                piece, data = data[:cap], data[cap:]
            super().data_received(piece)
            if self.transport.is_closing() or self._unreadable:  # the parser refused it
                return

    # Parser callbacks

    def on_message_begin(self) -> None:
        self._start_waiting_for_headers()  # a pipelined request, or the first byte after idle
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._stop_waiting_for_headers()
        super().on_headers_complete()
        # Without a body the parser calls on_message_complete right away, which undoes this.
        self._awaiting_body = True
        self._body_progress_at = self.loop.time()
        self._arm_body_timer(self.guard.body_read_timeout_s)

    def on_body(self, body: bytes) -> None:
        self._body_progress_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_waiting_for_body()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """Answer a request the parser refused, in OpenAI's shape where the connection allows
        (uvicorn calls this from inside its `except httptools.HttpParserError`)."""
        self._unreadable = True
        self._stop_waiting_for_headers()
        error = APIError.invalid(_parse_failure(sys.exception()), code="invalid_http_request")
        cycle = self.cycle
        if not self._awaiting_body:  # a request's head: no request of its own was started
            self._give_up_on_headers(error)
            return
        # The body of `cycle`, the newest request, broke (a bad chunk, say).
        self._stop_waiting_for_body()
        queued = [index for index, (waiting, _) in enumerate(self.pipeline) if waiting is cycle]
        if queued:  # it waits behind an earlier request: answered in its turn, then closed
            cycle.keep_alive = False
            # uvicorn types its apps with its own TypedDicts; any ASGI app runs there.
            self.pipeline[queued[0]] = (cycle, _Answer(error))  # type: ignore[assignment]
            return
        cycle.disconnected = True  # its app reads a disconnect; what it sends is dropped
        cycle.message_event.set()
        if cycle.response_started:  # answered already (early, without its body): cut short
            self.transport.close()
            return
        told = cycle.scope.setdefault("state", {})  # for its audit event (the app's side)
        told["status_sent"], told["api_error"] = 400, error
        self._answer_and_close(error)

    # Headers

    def _start_waiting_for_headers(self) -> None:
        if self._pending:
            return
        # Only a new connection is refused: one already being served keeps its place.
        self.guard.pending += 1
        self._pending = True
        self._header_bytes = 0
        self._arm_header_timer()

    def _stop_waiting_for_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._pending:
            self._pending = False
            self.guard.pending -= 1

    def _arm_header_timer(self) -> None:
        # The deadline runs from the request's start: bytes that trickle in do not extend it.
        timeout = self.guard.header_read_timeout_s
        self._header_timer = self.loop.call_later(timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        self.guard.slow_headers.warning(
            "closed a connection from %s: no complete request headers within %.1f s",
            self._peer,
            self.guard.header_read_timeout_s,
        )
        self._give_up_on_headers(None)

    def _give_up_on_headers(self, error: APIError | None) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request on this connection is still being answered: let it finish,
            # read nothing more, and close once it is done (an answer now would interleave).
            self.cycle.keep_alive = False
            self.flow.pause_reading()
        elif error is not None:
            self._answer_and_close(error)
        else:
            self.transport.close()

    # Body

    def _stop_waiting_for_body(self) -> None:
        self._awaiting_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_body_timer(self, delay_s: float) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(delay_s, self._check_body)

    def _reading_resumed(self) -> None:
        if self._awaiting_body:  # we made the client wait; its clock starts again now
            self._body_progress_at = self.loop.time()

    def _check_body(self) -> None:
        self._body_timer = None
        now = self.loop.time()
        if self.flow.read_paused or self.pipeline or self.cycle.waiting_for_100_continue:
            self._body_progress_at = now  # the client is waiting on us, not we on it
        remaining = self._body_progress_at + self.guard.body_read_timeout_s - now
        if remaining > 0:
            self._arm_body_timer(remaining)
            return
        self._stop_waiting_for_body()
        self.guard.stalled_bodies.warning(
            "abandoned a request from %s: no body bytes for %.1f s",
            self._peer,
            self.guard.body_read_timeout_s,
        )
        cycle = self.cycle
        # The app now reads a disconnect and anything it sends is dropped: the answer below
        # (or, with a response under way, the close) is the request's end.
        cycle.disconnected = True
        cycle.message_event.set()
        if cycle.response_started:
            self.transport.close()
            return
        # Told to the app's side, which never sees this response, for the request's audit event.
        cycle.scope.setdefault("state", {})["status_sent"] = 408
        self._answer_and_close(APIError.body_stalled(self.guard.body_read_timeout_s))

    def _answer_and_close(self, error: APIError) -> None:
        """Write an error response in OpenAI's shape ourselves, then close the connection."""
        if self.transport.is_closing():  # the parser has already answered and closed
            return
        body = json.dumps(error.body()).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *((name.encode(), value.encode()) for name, value in error.headers.items()),
        ]
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(STATUS_LINE[error.status] + head + b"\r\n" + body)
        self.transport.close()


class _Answer:
    """An ASGI app that answers only with an error (a refused request's turn in a pipeline)."""

    def __init__(self, error: APIError) -> None:
        self.error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.error.response()(scope, receive, send)


def _parse_failure(error: BaseException | None) -> str:
    """What was wrong with a refused request: the parser's reason (llhttp's fixed texts, such
    as "Invalid header value char"), never an exception of our own callbacks."""
    if isinstance(error, httptools.HttpParserError) and not isinstance(
        error, httptools.HttpParserCallbackError
    ):
        return f"the request is not valid HTTP/1.1: {error}"
    return "the request is not valid HTTP/1.1"


def trusted_proxy_networks(entries: list[str]) -> list[str]:
    """The `trusted_proxies` entries as normalized networks; a malformed one is an error."""
    networks = []
    for entry in entries:
        try:
            networks.append(str(ipaddress.ip_network(entry.strip(), strict=False)))
        except ValueError as error:
            raise InvalidTrustedProxy(f"trusted_proxies: {entry!r} is not an IP or CIDR") from error
    return networks


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration the gateway runs with; `overrides` go to `uvicorn.Config`."""
    guarded = _GUARDED_OPTIONS & overrides.keys()
    if guarded:
        raise TypeError(f"set by the gateway's settings, not overridable: {sorted(guarded)}")
    guard = ConnectionGuard(
        header_read_timeout_s=settings.header_read_timeout_s,
        body_read_timeout_s=settings.body_read_timeout_s,
        max_pending_connections=settings.max_pending_connections,
    )
    # One subclass per server, so that servers in one process do not share a pending count.
    protocol = type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {"guard": guard})
    proxies = trusted_proxy_networks(settings.trusted_proxies)
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "timeout_graceful_shutdown": int(settings.shutdown_grace_s),
        **overrides,
        "http": protocol,
        "ws": "none",  # the gateway serves no WebSockets; an upgrade would escape these bounds
        # uvicorn trusts 127.0.0.1 by default; we trust exactly the configured proxies.
        "proxy_headers": bool(proxies),
        "forwarded_allow_ips": proxies,
    }
    return uvicorn.Config(app, **options)
