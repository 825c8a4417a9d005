"""Keeps a running gateway in step with tenancy changes made anywhere (CLI, other replicas).

The gateway reads the database's change counter, one single-row read, whenever PostgreSQL
notifies it of a committed change (tenancy/change_feed.py) and every `tenancy_poll_s` (1 s) in any
case. When it moved, cached key checks are dropped (so a revoked key, a suspended tenant or
changed limits apply to the next request), changed cache quotas go to the engine at once, and
a deleted tenant's cached KV blocks are purged (dropped and zeroed). The engine is also handed
the database's whole view, every budget and every deleted tenant (`know_tenants`): a routing
gateway gives it to a worker that missed a change when it comes back.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from engine.cache.budget import Owner, TenantBudget
from gateway.auth.key_auth import KeyAuthenticator
from gateway.runtime.seal_keys import SealKeyCache
from gateway.runtime.serving_engine import ServingEngine
from gateway.runtime.usage_history import UsageHistory
from tenancy import change_feed
from tenancy.change_feed import TenantRow
from tenancy.store import Store

logger = logging.getLogger(__name__)


@dataclass
class TenancySync:
    store: Store
    engine: ServingEngine
    auth: KeyAuthenticator
    usage: UsageHistory | None = None  # a deleted tenant's live usage is forgotten too
    seal_keys: SealKeyCache | None = None  # and its data key, if this gateway read it
    seq: int | None = None
    tenants: dict[str, TenantRow] = field(default_factory=dict)
    # The background poll and an admin call's own poll (after its change) may overlap.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def poll(self) -> bool:
        """Apply whatever changed since the last poll; returns whether anything did.

        Blocking (database reads, engine calls): run it off the event loop.
        """
        with self._lock:
            return self._poll()

    def _poll(self) -> bool:
        with self.store.transaction() as session:
            seq = change_feed.current_seq(session)
            if seq == self.seq:
                return False
            tenants = change_feed.tenant_budgets(session)
        first, self.seq = self.seq is None, seq
        previous, self.tenants = self.tenants, tenants
        self.auth.forget_all()
        budgets: dict[Owner, TenantBudget] = {
            row.tenant_id: _budget(row) for row in tenants.values() if row.status != "deleted"
        }
        deleted = frozenset(t for t, row in tenants.items() if row.status == "deleted")
        self.engine.know_tenants(budgets, deleted)
        if first:  # the engine learns budgets from requests until something changes
            return True
        for tenant_id, row in tenants.items():
            before = previous.get(tenant_id)
            if row.status == "deleted":
                if before is None or before.status != "deleted":
                    if self.seal_keys is not None:
                        self.seal_keys.forget_tenant(tenant_id)
                    purged = self.engine.purge_tenant(tenant_id)
                    logger.info("tenant %s deleted: purged %d cached blocks", row.slug, purged)
                    if self.usage is not None:
                        self.usage.forget(tenant_id)
            elif before is None or _budget(before) != _budget(row):
                self._set_budget(row)
        return True

    def _set_budget(self, row: TenantRow) -> None:
        try:
            self.engine.set_budget(row.tenant_id, _budget(row))
        except ValueError as error:  # reservations beyond the pool: requests cut them instead
            logger.warning("cache budget of tenant %s not applied: %s", row.slug, error)


def _budget(row: TenantRow) -> TenantBudget:
    return TenantBudget(
        row.cache_quota_blocks,
        row.cache_reservation_blocks,
        row.tier_quota_bytes,
        row.tier_reservation_bytes or 0,
    )
