"""Admission: each request's concurrency slots, requests and tokens, taken from its tenant's
limits in the configured store.

An inference request's admission has two steps. `Admission.enter` takes a concurrency slot
and a request from the window as soon as the key is known, before the request is templated or
tokenized, so one tenant's requests never occupy more of that work than its concurrency
allows. `charge` then takes the tokens the request may cost, once they are counted, and one
more slot for each choice past the first: a request for n choices runs n sequences, and counts
as n requests against the tenant's concurrency. `release`, called once when the request is
settled, gives the slots back and refunds the tokens it did not use. Any other request of a
tenant's (listing models) is `count`ed: one request of the window and no slot, so a tenant
flooding it meets the same 429 and rate-limit headers as its completions, and never waits on
its own streams' slots.

Where limits live: with `redis_url`, in Redis (redis_store.py), shared by every gateway, so a
tenant's limits hold once however many gateways serve it; without it, in this process
(process_store.py), which is right for one gateway and multiplies a tenant's limits by the
number of gateways otherwise.

When Redis does not answer (each call has a short timeout), the limiter **fails open**: it
limits in this process until a probe finds Redis again, with a log line and a metric. Failing
closed would turn an outage of a store that holds no tenant data into an outage of every
tenant's inference; failing open keeps every tenant within its limits on each gateway (at most
the number of gateways times its limits, for the length of the outage), which an attacker
cannot stretch: no request of theirs can make Redis fail. No request ever waits on a Redis
known to be down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from gateway.auth.key_auth import Caller
from gateway.errors import APIError
from gateway.limits.process_store import ProcessLimits
from gateway.limits.store import (
    HeldLease,
    Limits,
    LimitStore,
    LimitStoreDown,
    LimitStoreFailed,
    Refusal,
    Verdict,
    WindowUsage,
    whole_seconds,
)

logger = logging.getLogger(__name__)
# How often a limiter that fell back asks Redis whether it answers again.
PROBE_S = 1.0
FAILURE_LOG_S = 60.0
# What a step that could not be counted answers: let through, nothing known of the windows.
_UNCOUNTED = Verdict(WindowUsage(0, 0.0, 0, 0.0))
_ROUND_TRIP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

_MESSAGES = {
    Refusal.CONCURRENCY: "too many concurrent requests for this tenant",
    Refusal.REQUESTS: "request rate limit reached for this tenant",
    Refusal.TOKENS: "token rate limit reached for this tenant",
}


@dataclass
class Admission:
    """One request's hold on its tenant's limits: entered once, charged once, released once."""

    limiter: Limiter
    caller: Caller
    lease_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    store: LimitStore | None = None  # where its slots are held, once entered
    slots: int = 0
    reserved_tokens: int = 0
    usage: WindowUsage | None = None  # the tenant's windows as the last step saw them
    released: bool = False

    async def enter(self) -> None:
        """Take a concurrency slot and one request, or raise a 429 with Retry-After."""
        self.store, verdict = await self.limiter.step(
            None, lambda store: store.enter(self.caller.tenant_id, self.lease_id, self.limits)
        )
        self.usage = verdict.usage
        _raise_if_refused(verdict)
        self.slots = 1
        self.limiter.hold(self)

    async def count(self) -> None:
        """Take one request and no slot, for a request that holds nothing while it runs
        (listing models), or raise a 429 with Retry-After; there is nothing to release."""
        self.store, verdict = await self.limiter.step(
            None, lambda store: store.count(self.caller.tenant_id, self.lease_id, self.limits)
        )
        self.usage = verdict.usage
        _raise_if_refused(verdict)

    async def charge(self, tokens: int, choices: int = 1) -> None:
        """Take `tokens` from the tenant's per-minute budget and a concurrency slot for each
        choice past the first, or raise a 429: a 400 for more choices than the tenant may ever
        run at once; for more tokens than its per-minute limit, a 429 coded
        `tokens_per_minute_exceeded` (as OpenAI answers it), whose wait cannot help."""
        limits = self.limits
        if choices > limits.max_concurrent:
            message = (
                f"n={choices} is more than this tenant's {limits.max_concurrent} "
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
        extra = choices - 1
        tenant_id, lease_id = self.caller.tenant_id, self.lease_id
        _, verdict = await self.limiter.step(
            self.store, lambda store: store.charge(tenant_id, lease_id, tokens, extra, limits)
        )
        self.usage = verdict.usage
        if verdict.refusal is Refusal.CONCURRENCY:
            message = "too many concurrent requests for this tenant (each choice counts)"
            raise APIError.rate_limited(message, whole_seconds(verdict.retry_after_s))
        _raise_if_refused(verdict)
        self.reserved_tokens = tokens
        self.slots = choices

    def release(self, used_tokens: int | None = None) -> None:
        """Give back the slots and the tokens not used (those reserved, if unknown)."""
        if self.released or self.store is None or not self.slots:
            return
        self.released = True
        refund = 0 if used_tokens is None else max(0, self.reserved_tokens - used_tokens)
        self.limiter.let_go(self, refund)

    @property
    def limits(self) -> Limits:
        tenant = self.caller.tenant
        return Limits(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's rate-limit headers: the limit, what remains and how long until the window
        is empty again, for requests and tokens, as the last step saw the tenant's windows."""
        if self.usage is None:
            return []
        limits, usage = self.limits, self.usage
        pairs = []
        for name, limit, used, reset in (
            ("requests", limits.requests_per_minute, usage.requests_used, usage.requests_reset_s),
            ("tokens", limits.tokens_per_minute, usage.tokens_used, usage.tokens_reset_s),
        ):
            pairs += [
                (f"x-ratelimit-limit-{name}", str(limit)),
                (f"x-ratelimit-remaining-{name}", str(max(0, limit - used))),
                (f"x-ratelimit-reset-{name}", _duration(reset)),
            ]
        return [(key.encode(), value.encode()) for key, value in pairs]


class Limiter:
    """Admissions against the configured store, falling back to this process's (fail-open)."""

    def __init__(
        self,
        shared: LimitStore | None = None,
        lease_s: float = 15.0,
    ) -> None:
        self.local = ProcessLimits()
        self.shared = shared
        self.shared_where = shared.where if shared is not None else None
        self.lease_s = lease_s
        self.shared_up = shared is not None
        self.fallbacks = 0  # admission steps taken here because the shared store was away
        self._failure_logged = -FAILURE_LOG_S
        # Unregistered: the gateway's metrics registry takes it (gateway/observability/metrics.py).
        self.round_trips = Histogram(
            "prefixgate_limits_round_trip_seconds",
            "Time one admission step took in the shared limit store.",
            buckets=_ROUND_TRIP_BUCKETS,
            registry=None,
        )
        self._held: dict[str, Admission] = {}  # admissions with slots in the shared store
        self._pending: set[asyncio.Task[None]] = set()

    def admission(self, caller: Caller) -> Admission:
        return Admission(self, caller)

    @property
    def mode(self) -> str:
        """Where limits are kept now: "redis", "process (redis away)" or "process"."""
        if self.shared is None:
            return "process"
        return self.shared.name if self.shared_up else f"process ({self.shared.name} away)"

    async def drain(self) -> None:
        """Wait for the releases under way (at shutdown; in tests)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=1.0)

    async def step(
        self, store: LimitStore | None, call: Callable[[LimitStore], Awaitable[Verdict]]
    ) -> tuple[LimitStore, Verdict]:
        """Run one admission step on `store` (None: the shared store if it is up, else this
        process's). A shared store that does not answer is marked away and the step runs here;
        one that answers with an error (its script's) runs this step here and stays in use.

        A step of an admission entered in the shared store that is away now (or fails) is let
        through uncounted, at once: its slot there lapses with its lease; refusing it would
        make Redis's outage the tenant's."""
        if store is not None and store is self.shared and not self.shared_up:
            return store, _UNCOUNTED
        chosen = store or (self.shared if self.shared_now else None)
        if chosen is not None and chosen is not self.local:
            started = time.perf_counter()
            try:
                verdict = await call(chosen)
            except LimitStoreDown as error:
                self._lost(error)
                if store is not None:
                    return store, _UNCOUNTED
            except LimitStoreFailed as error:
                self._failed(error)
                if store is not None:
                    return store, _UNCOUNTED
            else:
                self.round_trips.observe(time.perf_counter() - started)
                return chosen, verdict
        self.fallbacks += self.shared is not None
        verdict = await call(self.local)
        return self.local, verdict

    @property
    def shared_now(self) -> bool:
        """Whether tenants' limits are counted in the shared store now."""
        return self.shared is not None and self.shared_up

    def hold(self, admission: Admission) -> None:
        if admission.store is not None and admission.store is not self.local:
            self._held[admission.lease_id] = admission

    def let_go(self, admission: Admission, refund: int) -> None:
        """Release an admission's slots, on a task of its own (the response is not held up by
        a shared store's round trip)."""
        self._held.pop(admission.lease_id, None)
        store = admission.store
        assert store is not None
        tenant_id, lease_id, slots = admission.caller.tenant_id, admission.lease_id, admission.slots
        task = asyncio.get_running_loop().create_task(
            self._release(store, tenant_id, lease_id, slots, refund)
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(
        self, store: LimitStore, tenant_id: str, lease_id: str, slots: int, refund: int
    ) -> None:
        try:
            await store.release(tenant_id, lease_id, slots, refund)
        except LimitStoreDown as error:  # its lease lapses on its own
            self._lost(error)

    async def keep_leases(self) -> None:
        """Renew the shared store's leases of running requests every third of a lease, and
        probe a store that went away every `PROBE_S`; runs for the gateway's life."""
        shared = self.shared
        if shared is None:
            return
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(min(PROBE_S, self.lease_s / 3))
            try:
                if not self.shared_up:
                    await shared.ping()
                    self.shared_up = True
                    logger.warning("shared limits: %s answers again", self.shared_where)
                if time.monotonic() - renewed >= self.lease_s / 3:
                    renewed = time.monotonic()
                    await shared.renew(self.held_leases())
            except LimitStoreDown as error:
                self._lost(error)
            except Exception:  # never let renewals end: running requests would lose slots
                logger.exception("shared limits: renewing leases failed; trying again")

    def held_leases(self) -> list[HeldLease]:
        """The shared store's leases of this gateway's running requests."""
        return [
            HeldLease(admission.caller.tenant_id, admission.lease_id, admission.slots)
            for admission in list(self._held.values())
            if admission.store is self.shared
        ]

    def _failed(self, error: LimitStoreFailed) -> None:
        """The shared store answered with an error (a script's, a full Redis): logged at most
        once a minute; the store stays in use."""
        now = time.monotonic()
        if now - self._failure_logged >= FAILURE_LOG_S:
            self._failure_logged = now
            logger.error(
                "shared limits: %s answered with an error (%s); the step was counted in this "
                "process (logged at most once a minute)",
                self.shared_where,
                error,
            )

    def _lost(self, error: LimitStoreDown) -> None:
        if self.shared_up:
            logger.warning(
                "shared limits: %s did not answer (%s); limiting each tenant in this process "
                "until it does (fail-open)",
                self.shared_where,
                error,
            )
        self.shared_up = False

    async def close(self) -> None:
        await self.drain()
        if self.shared is not None:
            await self.shared.close()


def _raise_if_refused(verdict: Verdict) -> None:
    if verdict.refusal is not None:
        message = _MESSAGES[verdict.refusal]
        raise APIError.rate_limited(message, whole_seconds(verdict.retry_after_s))


def _duration(seconds: float) -> str:
    """A wait as OpenAI writes it in x-ratelimit-reset-*: "0s", "1.5s", "6m0s"."""
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
