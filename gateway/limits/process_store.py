"""The in-process limit store: each tenant's windows and slots in this process's memory.

It is the store of a single gateway (the embedded default) and the one every gateway falls
back to while its shared store does not answer. Its slots need no lease: they die with the
process that holds them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.limits.store import (
    CONCURRENCY_RETRY_S,
    WINDOW_S,
    HeldLease,
    Limits,
    Refusal,
    Verdict,
    WindowUsage,
    window_wait,
)


@dataclass
class _Window:
    """Entries (time, amount, lease) of the last minute, oldest first, and their sum."""

    entries: deque[tuple[float, int, str]] = field(default_factory=deque)
    total: int = 0

    def forget_until(self, cutoff: float) -> None:
        while self.entries and self.entries[0][0] <= cutoff:
            self.total -= self.entries.popleft()[1]

    def add(self, now: float, amount: int, lease_id: str) -> None:
        self.entries.append((now, amount, lease_id))
        self.total += amount

    def refund(self, lease_id: str, amount: int) -> None:
        for index, (when, charged, lease) in enumerate(self.entries):
            if lease == lease_id:
                back = min(charged, amount)
                self.entries[index] = (when, charged - back, lease)
                self.total -= back
                return

    def reset_s(self, now: float, window_s: float) -> float:
        return max(0.0, self.entries[-1][0] + window_s - now) if self.entries else 0.0


@dataclass
class _Tenant:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    slots: int = 0


class ProcessLimits:
    """Limits kept in this process (`LimitStore`)."""

    name = "process"
    where = "this process"

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S
    ) -> None:
        self._clock = clock
        self._window_s = window_s
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.Lock()

    async def enter(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        with self._lock:
            now, tenant = self._tenant(tenant_id)
            if tenant.slots >= limits.max_concurrent:
                return self._refused(tenant, now, Refusal.CONCURRENCY, CONCURRENCY_RETRY_S)
            refused = self._requests_refusal(tenant, now, limits)
            if refused is not None:
                return refused
            tenant.requests.add(now, 1, lease_id)
            tenant.slots += 1
            return Verdict(self._usage(tenant, now))

    async def count(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        with self._lock:
            now, tenant = self._tenant(tenant_id)
            refused = self._requests_refusal(tenant, now, limits)
            if refused is not None:
                return refused
            tenant.requests.add(now, 1, lease_id)
            return Verdict(self._usage(tenant, now))

    async def charge(
        self, tenant_id: str, lease_id: str, tokens: int, extra_slots: int, limits: Limits
    ) -> Verdict:
        with self._lock:
            now, tenant = self._tenant(tenant_id)
            if tenant.slots + extra_slots > limits.max_concurrent:
                return self._refused(tenant, now, Refusal.CONCURRENCY, CONCURRENCY_RETRY_S)
            window = tenant.tokens
            if window.total + tokens > limits.tokens_per_minute:
                wait = self._wait(window, tokens, limits.tokens_per_minute, now)
                return self._refused(tenant, now, Refusal.TOKENS, wait)
            if tokens > 0:  # as in Redis: a charge of nothing leaves no entry
                window.add(now, tokens, lease_id)
            tenant.slots += extra_slots
            return Verdict(self._usage(tenant, now))

    async def release(self, tenant_id: str, lease_id: str, slots: int, refund: int) -> None:
        with self._lock:
            tenant = self._tenants.get(tenant_id)
            if tenant is None:
                return
            tenant.slots = max(0, tenant.slots - slots)
            if refund > 0:
                tenant.tokens.refund(lease_id, refund)

    async def renew(self, leases: Sequence[HeldLease]) -> None:
        """Nothing to do: slots held here live as long as the process."""

    async def ping(self) -> None:
        """Always answers."""

    async def close(self) -> None:
        """Nothing to close."""

    def slots_held(self, tenant_id: str) -> int:
        """The tenant's slots held now (for checks that everything came back)."""
        with self._lock:
            tenant = self._tenants.get(tenant_id)
            return tenant.slots if tenant is not None else 0

    def _tenant(self, tenant_id: str) -> tuple[float, _Tenant]:
        """Now, and the tenant's state with the window's old entries forgotten (locked)."""
        now = self._clock()
        tenant = self._tenants.setdefault(tenant_id, _Tenant())
        tenant.requests.forget_until(now - self._window_s)
        tenant.tokens.forget_until(now - self._window_s)
        return now, tenant

    def _requests_refusal(self, tenant: _Tenant, now: float, limits: Limits) -> Verdict | None:
        """The refusal when the window already holds the tenant's requests per minute."""
        requests = tenant.requests
        if requests.total + 1 <= limits.requests_per_minute:
            return None
        wait = self._wait(requests, 1, limits.requests_per_minute, now)
        return self._refused(tenant, now, Refusal.REQUESTS, wait)

    def _wait(self, window: _Window, wanted: int, limit: int, now: float) -> float:
        entries = [(when, amount) for when, amount, _ in window.entries]
        return window_wait(entries, window.total, wanted, limit, now, self._window_s)

    def _usage(self, tenant: _Tenant, now: float) -> WindowUsage:
        return WindowUsage(
            requests_used=tenant.requests.total,
            requests_reset_s=tenant.requests.reset_s(now, self._window_s),
            tokens_used=tenant.tokens.total,
            tokens_reset_s=tenant.tokens.reset_s(now, self._window_s),
        )

    def _refused(self, tenant: _Tenant, now: float, refusal: Refusal, wait: float) -> Verdict:
        return Verdict(self._usage(tenant, now), refusal, wait)
