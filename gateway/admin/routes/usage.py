"""Cache usage under /admin/api: each tenant now and over the recent window, and request totals
over longer ranges from the audit log (gateway/admin/service/usage.py says where each comes
from). A tenant-admin sees its own tenant only: another tenant's id is the same 404 as a
missing one.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import IsoTime
from gateway.admin.service import usage
from gateway.admin.service.usage import DEFAULT_WINDOW_S, TenantUsage, UsagePage, UsageTotals
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

router = APIRouter(prefix="/admin/api", tags=["admin: usage"], responses=ADMIN_RESPONSES)

WindowQuery = Annotated[
    int, Query(ge=1, le=86_400, description="Seconds of recent history (what the gateway keeps)")
]


@router.get("/tenants/{tenant_id}/usage")
def show_tenant_usage(
    tenant_id: uuid.UUID,
    caller: AdminDep,
    state: StateDep,
    window_s: WindowQuery = DEFAULT_WINDOW_S,
) -> TenantUsage:
    """One tenant's blocks now, its samples over the window (for a chart) and their summary."""
    return usage.tenant_usage(state, caller, tenant_id, window_s)


@router.get("/usage")
def list_usage(
    caller: AdminDep,
    state: StateDep,
    window_s: WindowQuery = DEFAULT_WINDOW_S,
    q: Annotated[str, Query(max_length=100, description="Part of a slug or name")] = "",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> UsagePage:
    """One row per live tenant (by slug): blocks now vs quota and the window's activity."""
    return usage.usage_table(state, caller, window_s, q, limit, offset)


@router.get("/tenants/{tenant_id}/usage/totals")
def show_usage_totals(
    tenant_id: uuid.UUID,
    caller: AdminDep,
    state: StateDep,
    since: Annotated[
        IsoTime | None, Query(description="Inclusive; default: 30 days before until")
    ] = None,
    until: Annotated[IsoTime | None, Query(description="Exclusive; default: now")] = None,
) -> UsageTotals:
    """The tenant's /v1 requests over a range of at most 90 days, from the audit log."""
    return usage.usage_totals(state, caller, tenant_id, since, until)
