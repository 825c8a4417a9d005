"""Tenants: list (paged, searchable), create, show, update (limits, sharing, scheduling weight),
cache quota (in the pool and in the second KV tier), suspend/resume, delete.

A tenant-admin sees its own tenant only (any other id is a 404) and changes none of these:
they are the operator's. Every change is audited with the tenant before and after, and applies
to this process before the answer (a quota shrink has already evicted the tenant's least
recently used cached blocks, and the answer's `cache` shows the engine after it). A deletion's
event also says whether the tenant's data key was shredded (`data_key_shredded`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from engine.math_utils import cdiv
from gateway.admin.audited_change import Action, Changed, apply_change
from gateway.admin.callers import AdminCaller, visible_tenant, visible_tenants
from gateway.admin.outputs import tenant_out
from gateway.admin.schemas import QuotaUpdate, TenantCreate, TenantOut, TenantPage, TenantUpdate
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import tenants
from tenancy.models import Tenant


def list_tenants(
    state: GatewayState, caller: AdminCaller, q: str = "", limit: int = 50, offset: int = 0
) -> TenantPage:
    """One page of live tenants by slug whose slug or name contains `q` (a tenant-admin: its
    own tenant only)."""
    with state.store.transaction() as session:
        rows, total = visible_tenants(session, caller, q, limit, offset)
        data = [tenant_out(state, tenant) for tenant in rows]
    return TenantPage(data=data, total=total, limit=limit, offset=offset)


def create_tenant(state: GatewayState, caller: AdminCaller, body: TenantCreate) -> TenantOut:
    """Create an active tenant (admins only)."""
    limits = tenants.TenantLimits(
        cache_quota_blocks=body.cache_quota_blocks,
        cache_reservation_blocks=body.cache_reservation_blocks,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
        max_concurrent=body.max_concurrent,
        scheduling_weight=body.scheduling_weight,
        tier_quota_bytes=body.tier_quota_bytes,
        tier_reservation_bytes=body.tier_reservation_bytes,
    )

    def change(session: Session) -> Changed[uuid.UUID]:
        tenant = tenants.create_tenant(
            session,
            body.slug,
            body.display_name,
            body.sharing_mode,
            limits,
            body.may_use_public_prefixes,
        )
        return Changed(tenant.id, str(tenant.id), None, tenants.tenant_settings(tenant))

    action = Action("tenant.create", "tenant", body.slug, admin_only=True)
    return show_tenant(state, caller, apply_change(state, caller, action, change))


def show_tenant(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> TenantOut:
    """One tenant the caller sees, with its cache usage in the running engine."""
    with state.store.transaction() as session:
        return tenant_out(state, visible_tenant(session, caller, tenant_id))


def update_tenant(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, body: TenantUpdate
) -> TenantOut:
    """Change the display name, sharing mode, public-prefix use, request limits or scheduling
    weight (the tenant's next request carries the new weight to the engine)."""
    changes = tenants.TenantChanges(**body.model_dump(exclude_unset=True))

    def change(session: Session, tenant: Tenant) -> Tenant:
        return tenants.update_tenant(session, tenant.slug, changes)

    _change_tenant(state, caller, tenant_id, "tenant.update", change)
    return show_tenant(state, caller, tenant_id)


def set_quota(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, body: QuotaUpdate
) -> TenantOut:
    """Set the cache quota and/or reservation, in blocks or tokens, and/or the tier quota and
    reservation, in bytes; applied to the engine now."""

    def change(session: Session, tenant: Tenant) -> Tenant:
        quota = _blocks(state, body.quota_blocks, body.quota_tokens, "quota")
        reservation = _blocks(
            state, body.reservation_blocks, body.reservation_tokens, "reservation"
        )
        return tenants.set_quota(session, tenant.slug, quota, reservation, **body.tier_changes())

    _change_tenant(state, caller, tenant_id, "tenant.set_quota", change)
    return show_tenant(state, caller, tenant_id)


def suspend_tenant(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> TenantOut:
    """Suspend a tenant: its keys stop working (within a poll in every gateway)."""
    return _set_status(state, caller, tenant_id, "tenant.suspend", "suspended")


def resume_tenant(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> TenantOut:
    """Reactivate a suspended tenant."""
    return _set_status(state, caller, tenant_id, "tenant.resume", "active")


def delete_tenant(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> None:
    """Delete a tenant: keys revoked, cached KV blocks purged and zeroed, data key shredded
    (its second-tier blocks unreadable at once); the audit trail stays."""

    def change(session: Session, tenant: Tenant) -> tuple[Tenant, dict[str, Any]]:
        deleted = tenants.delete_tenant(session, tenant.slug)
        return deleted.tenant, {"data_key_shredded": deleted.data_key_shredded}

    _audited_tenant_change(state, caller, tenant_id, "tenant.delete", change)


def _set_status(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, action: str, status: str
) -> TenantOut:
    def change(session: Session, tenant: Tenant) -> Tenant:
        return tenants.set_status(session, tenant.slug, status)

    _change_tenant(state, caller, tenant_id, action, change)
    return show_tenant(state, caller, tenant_id)


def _change_tenant(
    state: GatewayState,
    caller: AdminCaller,
    tenant_id: uuid.UUID,
    action: str,
    change: Callable[[Session, Tenant], Tenant],
) -> None:
    """Apply `change` to a tenant the caller sees (admins only), audited before and after."""
    _audited_tenant_change(state, caller, tenant_id, action, lambda s, t: (change(s, t), {}))


def _audited_tenant_change(
    state: GatewayState,
    caller: AdminCaller,
    tenant_id: uuid.UUID,
    action: str,
    change: Callable[[Session, Tenant], tuple[Tenant, dict[str, Any]]],
) -> None:
    """`_change_tenant` for a change that says more than the tenant after it: what else it
    did goes into the event's details."""

    def audited(session: Session) -> Changed[None]:
        tenant = visible_tenant(session, caller, tenant_id)
        before = tenants.tenant_settings(tenant)
        changed, details = change(session, tenant)
        return Changed(None, str(tenant_id), before, tenants.tenant_settings(changed), details)

    resource = Action(action, "tenant", str(tenant_id), str(tenant_id), admin_only=True)
    apply_change(state, caller, resource, audited)


def _blocks(state: GatewayState, blocks: int | None, tokens: int | None, what: str) -> int | None:
    """A size given in blocks or in tokens (rounded up to whole blocks), not both."""
    if blocks is not None and tokens is not None:
        raise APIError.invalid(
            f"give the {what} in blocks or in tokens, not both", f"{what}_tokens"
        )
    if tokens is not None:
        return cdiv(tokens, state.settings.block_size)
    return blocks
