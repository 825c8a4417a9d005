"""KV pools: each served model's pool, its workers and who holds what.

A gateway serves one model from its own engine, or several from engine workers; each model's
workers form its pool, and a tenant's quota and reservation hold separately in every pool (and
on every worker of it). For each pool the answer gives its workers (address, whether in
routing, load, last error), its size and free blocks, and every owner's blocks there (active,
cached, reserved, quota) with its prompt tokens, cached tokens and hit ratio: the public
budget's first, then the tenants that hold or reserve blocks there or have sent prompts, by
slug. The figures are the engine's now, summed over the pool's workers as of their last poll.

An admin sees everything. A tenant-admin sees each pool with its own tenant's row only: no
worker addresses, no other tenant, no public budget, and no free blocks (they move with other
tenants' traffic).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.stats import OwnerStats
from gateway.admin.callers import AdminCaller, visible_tenant
from gateway.admin.outputs import engine_pools, workers_without_model
from gateway.admin.schemas import PoolOut, PoolOwner, PoolsOut, PoolWorker, unseen_owner
from gateway.runtime.serving_engine import EnginePool
from gateway.state import GatewayState
from tenancy.models import Tenant

# Slugs are looked up this many owners at a time (a bound on a query's parameters).
_SLUG_BATCH = 500


def pools_view(state: GatewayState, caller: AdminCaller) -> PoolsOut:
    """Every pool as the caller may see it (blocking: database)."""
    pools = engine_pools(state)
    if not caller.is_admin:
        assert caller.tenant_id is not None  # a tenant-admin always has its tenant
        with state.store.transaction() as session:
            tenant = visible_tenant(session, caller, caller.tenant_id)
            return PoolsOut(
                pools=[_tenant_pool(pool, tenant) for pool in pools], workers_without_model=None
            )
    owners = {owner for pool in pools if pool.stats is not None for owner in pool.stats.owners}
    with state.store.transaction() as session:
        slugs = _live_slugs(session, owners)
    return PoolsOut(
        pools=[_admin_pool(pool, slugs) for pool in pools],
        workers_without_model=[_worker(row) for row in workers_without_model(state)],
    )


def _admin_pool(pool: EnginePool, slugs: dict[str, str]) -> PoolOut:
    """The whole pool: workers, size, free blocks and every owner's row."""
    owners = pool.stats.owners if pool.stats is not None else {}
    rows = [
        _owner_row(owner, stats, slugs.get(str(owner)))
        for owner, stats in owners.items()
        if owner is PUBLIC_OWNER or _in_use(stats)
    ]
    return PoolOut(
        model=pool.model,
        served=pool.served,
        total_blocks=pool.stats.num_blocks if pool.stats is not None else None,
        free_blocks=pool.stats.free_blocks if pool.stats is not None else None,
        workers=[_worker(row) for row in pool.workers],
        owners=sorted(rows, key=_owner_order),
    )


def _tenant_pool(pool: EnginePool, tenant: Tenant) -> PoolOut:
    """The pool as a tenant-admin sees it: its size and its own tenant's row."""
    owner = str(tenant.id)
    stats = pool.stats.owners.get(owner) if pool.stats is not None else None
    if stats is None:
        stats = unseen_owner(tenant.cache_quota_blocks, tenant.cache_reservation_blocks)
    return PoolOut(
        model=pool.model,
        served=pool.served,
        total_blocks=pool.stats.num_blocks if pool.stats is not None else None,
        free_blocks=None,
        workers=None,
        owners=[_owner_row(owner, stats, tenant.slug)],
    )


def _owner_row(owner: Owner, stats: OwnerStats, slug: str | None) -> PoolOwner:
    if owner is PUBLIC_OWNER:
        return PoolOwner.of(stats, owner=PUBLIC_OWNER.value, tenant_id=None, slug=None)
    return PoolOwner.of(stats, owner=str(owner), tenant_id=_uuid(str(owner)), slug=slug)


def _in_use(stats: OwnerStats) -> bool:
    """Whether the owner holds or reserves blocks, or has sent prompts: workers know every
    tenant's budget, and a pool's table lists those that use it."""
    held = stats.active_blocks + stats.cached_blocks + stats.reserved_blocks
    return held > 0 or stats.counters.prompt_tokens > 0


def _owner_order(row: PoolOwner) -> tuple[int, str]:
    """The public budget first, then tenants by slug, then owners no live tenant has."""
    if row.owner == PUBLIC_OWNER.value:
        return 0, ""
    return (1, row.slug) if row.slug is not None else (2, row.owner)


def _worker(row: dict[str, Any]) -> PoolWorker:
    return PoolWorker(
        url=row["url"],
        up=row["up"],
        in_flight=row["in_flight"],
        load=row["load"],
        cached_keys=row["cached_keys"],
        last_error=row["last_error"] or None,
    )


def _live_slugs(session: Session, owners: Iterable[Owner]) -> dict[str, str]:
    """The slug of each owner that is a live tenant, by its id as the engine names it."""
    ids = sorted({parsed for owner in owners if (parsed := _uuid(owner)) is not None})
    slugs: dict[str, str] = {}
    for start in range(0, len(ids), _SLUG_BATCH):
        query = select(Tenant.id, Tenant.slug).where(
            Tenant.id.in_(ids[start : start + _SLUG_BATCH]), Tenant.status != "deleted"
        )
        slugs.update((str(tenant_id), slug) for tenant_id, slug in session.execute(query))
    return slugs


def _uuid(owner: Owner) -> uuid.UUID | None:
    """The tenant id an owner names (None: the public budget, or not a tenant id)."""
    if owner is PUBLIC_OWNER:
        return None
    try:
        return uuid.UUID(str(owner))
    except ValueError:
        return None
