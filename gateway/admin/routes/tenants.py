"""Tenants under /admin/api/tenants: list (paged, searchable), create, show, update, cache
quota, suspend/resume, delete.

A tenant-admin sees its own tenant only (any other id is a 404) and changes none of these:
they are the operator's. Every change is audited with the tenant before and after, and applies
to this process before the answer (a quota shrink has already evicted the tenant's least
recently used cached blocks, and the answer's `cache` shows the engine after it).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Body, Query
from sqlalchemy.orm import Session

from engine.math_utils import cdiv
from gateway.admin.audited_change import Action, Changed, apply_change
from gateway.admin.callers import AdminCaller, visible_tenant, visible_tenants
from gateway.admin.outputs import tenant_out
from gateway.admin.schemas import QuotaUpdate, TenantCreate, TenantOut, TenantPage, TenantUpdate
from gateway.errors import APIError
from gateway.http.deps import AdminDep, StateDep
from gateway.http.openapi import ADMIN_RESPONSES
from gateway.state import GatewayState
from tenancy import tenants
from tenancy.models import Tenant

router = APIRouter(prefix="/admin/api/tenants", tags=["admin: tenants"], responses=ADMIN_RESPONSES)


@router.get("")
def list_tenants(
    caller: AdminDep,
    state: StateDep,
    q: Annotated[str, Query(max_length=100, description="Part of a slug or name")] = "",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> TenantPage:
    """Live tenants by slug; a tenant-admin gets its own tenant only."""
    with state.store.transaction() as session:
        rows, total = visible_tenants(session, caller, q, limit, offset)
        data = [tenant_out(state, tenant) for tenant in rows]
    return TenantPage(data=data, total=total, limit=limit, offset=offset)


@router.post("", status_code=201)
def create_tenant(
    body: Annotated[TenantCreate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Create an active tenant (quota default: 1024 blocks, at most the pool)."""
    limits = tenants.TenantLimits(
        cache_quota_blocks=body.cache_quota_blocks,
        cache_reservation_blocks=body.cache_reservation_blocks,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
        max_concurrent=body.max_concurrent,
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

    tenant_id = apply_change(
        state, caller, Action("tenant.create", "tenant", body.slug, admin_only=True), change
    )
    return _show(state, caller, tenant_id)


@router.get("/{tenant_id}")
def show_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """One tenant, with its cache usage in the running engine."""
    return _show(state, caller, tenant_id)


@router.patch("/{tenant_id}")
def update_tenant(
    tenant_id: uuid.UUID, body: Annotated[TenantUpdate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Change the display name, sharing mode, public-prefix use or request limits."""
    changes = tenants.TenantChanges(**body.model_dump(exclude_unset=True))
    _change_tenant(
        state,
        caller,
        tenant_id,
        "tenant.update",
        lambda session, tenant: tenants.update_tenant(session, tenant.slug, changes),
    )
    return _show(state, caller, tenant_id)


@router.put("/{tenant_id}/quota")
def set_quota(
    tenant_id: uuid.UUID, body: Annotated[QuotaUpdate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Set the cache quota and/or reservation, in blocks or tokens; applied to the engine now."""

    def change(session: Session, tenant: Tenant) -> Tenant:
        quota = _blocks(state, body.quota_blocks, body.quota_tokens, "quota")
        reservation = _blocks(
            state, body.reservation_blocks, body.reservation_tokens, "reservation"
        )
        return tenants.set_quota(session, tenant.slug, quota, reservation)

    _change_tenant(state, caller, tenant_id, "tenant.set_quota", change)
    return _show(state, caller, tenant_id)


@router.post("/{tenant_id}/suspend")
def suspend_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """Suspend a tenant: its keys stop working (within a poll in every gateway)."""
    _change_tenant(
        state,
        caller,
        tenant_id,
        "tenant.suspend",
        lambda session, tenant: tenants.set_status(session, tenant.slug, "suspended"),
    )
    return _show(state, caller, tenant_id)


@router.post("/{tenant_id}/resume")
def resume_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """Reactivate a suspended tenant."""
    _change_tenant(
        state,
        caller,
        tenant_id,
        "tenant.resume",
        lambda session, tenant: tenants.set_status(session, tenant.slug, "active"),
    )
    return _show(state, caller, tenant_id)


@router.delete("/{tenant_id}", status_code=204)
def delete_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> None:
    """Delete a tenant: keys revoked, cached KV blocks purged and zeroed; the audit trail stays."""
    _change_tenant(
        state,
        caller,
        tenant_id,
        "tenant.delete",
        lambda session, tenant: tenants.delete_tenant(session, tenant.slug),
    )


def _change_tenant(
    state: GatewayState,
    caller: AdminCaller,
    tenant_id: uuid.UUID,
    action: str,
    change: Callable[[Session, Tenant], Tenant],
) -> None:
    def audited(session: Session) -> Changed[None]:
        tenant = visible_tenant(session, caller, tenant_id)
        before = tenants.tenant_settings(tenant)
        after = tenants.tenant_settings(change(session, tenant))
        return Changed(None, str(tenant_id), before, after)

    resource = Action(action, "tenant", str(tenant_id), str(tenant_id), admin_only=True)
    apply_change(state, caller, resource, audited)


def _show(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> TenantOut:
    with state.store.transaction() as session:
        return tenant_out(state, visible_tenant(session, caller, tenant_id))


def _blocks(state: GatewayState, blocks: int | None, tokens: int | None, what: str) -> int | None:
    """A size given in blocks or in tokens (rounded up to whole blocks), not both."""
    if blocks is not None and tokens is not None:
        raise APIError.invalid(
            f"give the {what} in blocks or in tokens, not both", f"{what}_tokens"
        )
    if tokens is not None:
        return cdiv(tokens, state.settings.block_size)
    return blocks
