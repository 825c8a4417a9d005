"""What a gateway knows of one engine worker: where it is, whether it is in routing, its load
(in all, and per tenant), the keys it holds (published, or about to be), and what it missed
while it was away.

The `WorkerSet` (membership.py) writes these from its polls and admin calls, and routing reads
them, all under the set's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.cache.stats import CacheStats
from gateway.workers.activity import Activity

# How long keys of a request just sent to a worker count as held there (it publishes them
# with its next poll, once the prefill has run).
PENDING_KEYS_S = 30.0


@dataclass
class Worker:
    """What the gateway knows of one worker (guarded by the `WorkerSet`'s lock)."""

    url: str
    up: bool = False  # in routing: answering, caught up, ready and listed
    lost: bool = True  # its last poll or admin call failed (or none has succeeded yet)
    silent: bool = False  # ... because it answered nothing in time: a hung machine
    epoch: str | None = None
    model: str = ""  # the name clients ask for, as the worker announces it
    fingerprint: str = ""  # its weights, tokenizer and config (engine/model/loader.py)
    seq: int = 0
    keys: set[str] = field(default_factory=set)
    pending: dict[str, float] = field(default_factory=dict)  # key -> when it stops counting
    in_flight: int = 0  # this gateway's sequences there now
    tenant_in_flight: dict[str, int] = field(default_factory=dict)  # ... per tenant (none at 0)
    reported_load: int = 0  # sequences in flight there at the last poll (every gateway's)
    own_at_poll: int = 0  # how many of those were this gateway's
    own_tenants_at_poll: dict[str, int] = field(default_factory=dict)  # ... per tenant
    activity: Activity = field(default_factory=Activity)  # its last report (activity.py)
    free_blocks: int = 0
    stats: CacheStats | None = None
    state: dict[str, Any] = field(default_factory=dict)
    missed: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # withdrawn prefixes
    resync: bool = True  # budgets must be pushed before it is routable
    last_error: str = ""  # why it was last taken out of routing
    unlisted_since: float | None = None  # when discovery stopped naming it

    @property
    def load(self) -> int:
        """Sequences there now: this gateway's exactly, other gateways' as last polled."""
        return self.in_flight + max(0, self.reported_load - self.own_at_poll)

    def load_for(self, tenant_id: str) -> int:
        """What a request of `tenant_id` queues behind there, in sequences: its tenant's own,
        plus one share for each other tenant with work there (the worker's engine schedules
        fairly between tenants, so a flood weighs on its own tenant). The whole load where the
        worker does not report its tenants."""
        if self.activity.tenant_sequences is None:
            return self.load
        loads = self.tenant_loads()
        own = loads.get(tenant_id, 0)
        return own + len(loads) - (1 if own else 0)

    def tenant_loads(self) -> dict[str, int]:
        """Sequences there now of each tenant with work there: this gateway's exactly, other
        gateways' as last polled (what the worker reported beyond this gateway's then)."""
        loads = dict(self.tenant_in_flight)
        for tenant_id, reported in (self.activity.tenant_sequences or {}).items():
            others = reported - self.own_tenants_at_poll.get(tenant_id, 0)
            if others > 0:
                loads[tenant_id] = loads.get(tenant_id, 0) + others
        return loads

    def send(self, tenant_id: str, sequences: int) -> None:
        """Count a request's sequences as this gateway's there, from now."""
        self.in_flight += sequences
        self.tenant_in_flight[tenant_id] = self.tenant_in_flight.get(tenant_id, 0) + sequences

    def release(self, tenant_id: str, sequences: int) -> None:
        """Stop counting a request's sequences there: its stream ended."""
        self.in_flight -= sequences
        left = self.tenant_in_flight.get(tenant_id, 0) - sequences
        if left > 0:
            self.tenant_in_flight[tenant_id] = left
        else:
            self.tenant_in_flight.pop(tenant_id, None)

    def held(self, now: float) -> Held:
        """Keys it holds or will soon: published ones and those of requests just sent."""
        return Held(self.keys, self.pending, now)

    def forget_pending(self, now: float) -> None:
        """Drop pending keys that it never published in time."""
        self.pending = {key: until for key, until in self.pending.items() if until > now}


@dataclass(frozen=True, slots=True)
class Held:
    """Membership in a worker's keys, read in place (no copy per request)."""

    keys: set[str]
    pending: dict[str, float]
    now: float

    def __contains__(self, key: object) -> bool:
        return key in self.keys or self.pending.get(key, 0.0) > self.now  # type: ignore[call-overload]
