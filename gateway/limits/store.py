"""What a limit store promises: the rules both stores keep, and the answers they give.

A tenant's limits are three:
- requests per minute: at most that many requests admitted in any 60 seconds (a sliding
  window, not a bucket that refills: a burst never lets through more than the limit);
- tokens per minute: at most that many tokens charged in any 60 seconds, where a request is
  charged what it may cost (prompt + n x max_tokens) and given back, when it ends, what it did
  not use;
- concurrent requests: at most that many slots held at once, one per choice of a running
  request. A slot is a lease: the store forgets it when it is not renewed in time, so slots
  held by a gateway that died come back on their own.

Two stores keep these rules: `ProcessLimits` (this process alone) and `RedisLimits` (every
gateway sharing one Redis). Both are tested against the same contract (tests/gateway/limits).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

WINDOW_S = 60.0
# A refused concurrency slot may be free again as soon as any request of the tenant ends.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits, as its key check read them."""

    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


class Refusal(enum.Enum):
    """Which limit refused an admission step."""

    CONCURRENCY = "concurrency"
    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True)
class WindowUsage:
    """A tenant's use of its per-minute limits when a store last answered for it: what the
    window holds now and how long until it is empty again."""

    requests_used: int
    requests_reset_s: float
    tokens_used: int
    tokens_reset_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """A store's answer to one admission step."""

    usage: WindowUsage
    refusal: Refusal | None = None
    retry_after_s: float = 0.0

    @property
    def allowed(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, slots=True)
class HeldLease:
    """Slots a running request holds, for renewing them."""

    tenant_id: str
    lease_id: str
    slots: int


class LimitStoreDown(Exception):
    """The store did not answer in time (a shared store that is away)."""


class LimitStoreFailed(Exception):
    """The store answered with an error (a shared store's script failed, or it is full)."""


class LimitStore(Protocol):
    """Where a tenant's windows and slots live. Every method is one atomic step."""

    name: str  # "process" or "redis", for /readyz and logs
    where: str  # where it keeps them, for logs (never a password)

    async def enter(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        """Take one concurrency slot and one request of the window, or neither."""
        ...

    async def count(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        """Take one request of the window and no slot (a request that holds nothing while it
        runs, such as listing models), or nothing."""
        ...

    async def charge(
        self, tenant_id: str, lease_id: str, tokens: int, extra_slots: int, limits: Limits
    ) -> Verdict:
        """Take `tokens` of the window and `extra_slots` more slots for the lease, or neither."""
        ...

    async def release(self, tenant_id: str, lease_id: str, slots: int, refund: int) -> None:
        """Give back the lease's slots, and `refund` of the tokens it was charged."""
        ...

    async def renew(self, leases: Sequence[HeldLease]) -> None:
        """Keep these leases' slots held for another lease period."""
        ...

    async def ping(self) -> None:
        """Raise `LimitStoreDown` unless the store answers."""
        ...

    async def close(self) -> None: ...


def window_wait(
    entries: Sequence[tuple[float, int]],
    used: int,
    wanted: int,
    limit: int,
    now: float,
    window_s: float = WINDOW_S,
) -> float:
    """Seconds until `wanted` more (requests, or tokens) fit under `limit`, given the window's
    entries (time, amount), oldest first, which hold `used` in all: until the entry whose
    leaving makes room leaves (after a lowered limit, not the oldest); a whole window when
    nothing in it would (a limit of 0)."""
    for when, amount in entries:
        used -= amount
        if used + wanted <= limit:
            return max(0.0, when + window_s - now)
    return window_s if used + wanted > limit else 0.0


def whole_seconds(wait: float) -> int:
    """A wait as a Retry-After header gives it: whole seconds, at least one."""
    return max(1, math.ceil(wait)) if math.isfinite(wait) else int(WINDOW_S)
