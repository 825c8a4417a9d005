"""Per-tenant request, token and concurrency limits (token buckets, in this process).

Admission has two steps. `enter` takes a concurrency slot and a request from the bucket as
soon as the key is known, before the request is templated or tokenized, so one tenant's
requests never occupy more of that work than its concurrency allows. `Admission.charge` then
takes the tokens the request may cost, once they are counted, and one more slot for each
choice past the first: a request for n choices runs n sequences, and counts as n requests
against the tenant's concurrency.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.auth import Caller
from gateway.errors import APIError


@dataclass
class _Bucket:
    capacity: float
    level: float
    updated: float

    def take(self, amount: float, per_minute: float, now: float) -> float:
        """Take `amount`; returns 0 on success, else seconds until it would fit."""
        self.level = min(self.capacity, self.level + (now - self.updated) * per_minute / 60.0)
        self.updated = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) * 60.0 / per_minute if per_minute else math.inf

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class _TenantState:
    requests: _Bucket
    tokens: _Bucket
    active: int = 0


@dataclass
class Admission:
    """A request let in: charge its tokens once, release it exactly once when it ends."""

    limiter: RateLimiter
    caller: Caller
    reserved_tokens: int = 0
    slots: int = 1
    released: bool = field(default=False)

    def charge(self, tokens: int, choices: int = 1) -> None:
        """Take `tokens` from the tenant's per-minute budget and a concurrency slot for each
        choice past the first, or raise a 429 (a 400 for more choices than the tenant may
        ever run at once)."""
        self.limiter._charge(self.caller, tokens, choices - 1)
        self.reserved_tokens = tokens
        self.slots = choices

    def release(self, used_tokens: int | None = None) -> None:
        if not self.released:
            self.released = True
            self.limiter._release(
                self.caller.tenant_id, self.reserved_tokens, used_tokens, self.slots
            )


class RateLimiter:
    """Each tenant's request and token buckets and its requests in flight, in this process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._lock = threading.Lock()

    def enter(self, caller: Caller) -> Admission:
        """Take a concurrency slot and one request, or raise a 429 with Retry-After."""
        limits = caller.tenant
        now = self._clock()
        with self._lock:
            state = self._state(caller, now)
            if state.active >= limits.max_concurrent:
                raise _too_many("too many concurrent requests for this tenant", 1.0)
            wait = state.requests.take(1, limits.requests_per_minute, now)
            if wait:
                raise _too_many("request rate limit reached for this tenant", wait)
            state.active += 1
        return Admission(self, caller)

    def _state(self, caller: Caller, now: float) -> _TenantState:
        limits = caller.tenant
        state = self._tenants.get(caller.tenant_id)
        if state is None:
            state = _TenantState(
                _Bucket(limits.requests_per_minute, limits.requests_per_minute, now),
                _Bucket(limits.tokens_per_minute, limits.tokens_per_minute, now),
            )
            self._tenants[caller.tenant_id] = state
        # Limits can change while the process runs: follow the tenant's current values.
        state.requests.capacity = limits.requests_per_minute
        state.tokens.capacity = limits.tokens_per_minute
        return state

    def headers(self, caller: Caller) -> list[tuple[bytes, bytes]]:
        """OpenAI's rate-limit headers for the tenant, as its buckets stand now: the limit,
        what remains and how long until the bucket is full again, for requests and tokens."""
        limits = caller.tenant
        now = self._clock()
        with self._lock:
            state = self._state(caller, now)
            pairs = []
            for name, bucket, per_minute in (
                ("requests", state.requests, limits.requests_per_minute),
                ("tokens", state.tokens, limits.tokens_per_minute),
            ):
                bucket.take(0, per_minute, now)  # refills it to now
                missing = bucket.capacity - bucket.level
                reset = missing * 60.0 / per_minute if per_minute else 0.0
                pairs += [
                    (f"x-ratelimit-limit-{name}", str(per_minute)),
                    (f"x-ratelimit-remaining-{name}", str(max(0, math.floor(bucket.level)))),
                    (f"x-ratelimit-reset-{name}", _duration(reset)),
                ]
        return [(key.encode(), value.encode()) for key, value in pairs]

    def _charge(self, caller: Caller, tokens: int, extra_slots: int) -> None:
        limits = caller.tenant
        if 1 + extra_slots > limits.max_concurrent:
            message = (
                f"n={1 + extra_slots} is more than this tenant's {limits.max_concurrent} "
                "concurrent requests (each choice counts as one)"
            )
            raise APIError.invalid(message, "n")
        if tokens > limits.tokens_per_minute:
            raise APIError.rate_limited(
                "the request needs more tokens than the tenant's per-minute limit",
                retry_after=60,
                code="tokens_per_minute_exceeded",
                param="max_tokens",
            )
        now = self._clock()
        with self._lock:
            state = self._state(caller, now)
            if state.active + extra_slots > limits.max_concurrent:
                message = "too many concurrent requests for this tenant (each choice counts)"
                raise _too_many(message, 1.0)
            wait = state.tokens.take(tokens, limits.tokens_per_minute, now)
            if not wait:
                state.active += extra_slots
        if wait:
            raise _too_many("token rate limit reached for this tenant", wait)

    def _release(self, tenant_id: str, reserved: int, used: int | None, slots: int) -> None:
        with self._lock:
            state = self._tenants[tenant_id]
            state.active -= slots
            if used is not None and used < reserved:
                state.tokens.give_back(reserved - used)


def _too_many(message: str, wait: float) -> APIError:
    """429 with the whole seconds until the bucket could let the request in."""
    retry_after = max(1, math.ceil(wait)) if math.isfinite(wait) else 60
    return APIError.rate_limited(message, retry_after)


def _duration(seconds: float) -> str:
    """A wait as OpenAI writes it in x-ratelimit-reset-*: "0s", "1.5s", "6m0s"."""
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
