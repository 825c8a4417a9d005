"""One at a time per tenant: work that any tenant could make costly, done outside the slots
every tenant shares.

A structured output's grammar compiles in a process of its own within a time limit
(engine/structured/compile_pool.py), but while it compiles it must not hold one of the
gateway's shared preparation slots: two tenants' costly schemas would then stall every other
tenant's plain request for seconds. So a grammar compiles after its request left the slots,
and each tenant compiles one grammar at a time: a tenant's next costly schema waits behind its
own, never another tenant's, and a tenant holds at most one of the compile processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class TenantTurns:
    """At most one holder per tenant at a time; the others of that tenant wait in order.
    Tenants never wait on each other. A tenant's lock exists only while someone holds or
    waits for it, so made-up tenants cannot grow the map (on one event loop)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._holders: dict[str, int] = {}  # holding or waiting, per tenant

    @asynccontextmanager
    async def turn(self, tenant_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(tenant_id, asyncio.Lock())
        self._holders[tenant_id] = self._holders.get(tenant_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._holders[tenant_id] -= 1
            if not self._holders[tenant_id]:
                del self._holders[tenant_id], self._locks[tenant_id]

    def __len__(self) -> int:
        """Tenants holding or waiting for a turn now."""
        return len(self._locks)
