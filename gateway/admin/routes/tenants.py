"""Tenants under /admin/api/tenants: list (paged, searchable), create, show, update, cache
quota (pool and second tier), suspend/resume, delete.

A tenant-admin sees its own tenant only and changes none of these; every change is audited and
applied to this process before the answer (gateway/admin/service/tenants.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body, Query

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import QuotaUpdate, TenantCreate, TenantOut, TenantPage, TenantUpdate
from gateway.admin.service import tenants
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

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
    return tenants.list_tenants(state, caller, q, limit, offset)


@router.post("", status_code=201)
def create_tenant(
    body: Annotated[TenantCreate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Create an active tenant (quota default: 1024 blocks, at most the pool)."""
    return tenants.create_tenant(state, caller, body)


@router.get("/{tenant_id}")
def show_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """One tenant, with its cache usage in the running engine."""
    return tenants.show_tenant(state, caller, tenant_id)


@router.patch("/{tenant_id}")
def update_tenant(
    tenant_id: uuid.UUID, body: Annotated[TenantUpdate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Change the display name, sharing mode, public-prefix use, request limits or scheduling
    weight."""
    return tenants.update_tenant(state, caller, tenant_id, body)


@router.put("/{tenant_id}/quota")
def set_quota(
    tenant_id: uuid.UUID, body: Annotated[QuotaUpdate, Body()], caller: AdminDep, state: StateDep
) -> TenantOut:
    """Set the cache quota and/or reservation, in blocks or tokens, and/or the second tier's
    quota and reservation, in bytes (null: back to the default); applied to the engine now."""
    return tenants.set_quota(state, caller, tenant_id, body)


@router.post("/{tenant_id}/suspend")
def suspend_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """Suspend a tenant: its keys stop working (within a poll in every gateway)."""
    return tenants.suspend_tenant(state, caller, tenant_id)


@router.post("/{tenant_id}/resume")
def resume_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> TenantOut:
    """Reactivate a suspended tenant."""
    return tenants.resume_tenant(state, caller, tenant_id)


@router.delete("/{tenant_id}", status_code=204)
def delete_tenant(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> None:
    """Delete a tenant: keys revoked, cached KV blocks purged and zeroed, data key shredded;
    the audit trail stays."""
    tenants.delete_tenant(state, caller, tenant_id)
