"""The data behind a tenant page's live chart: `GET /admin/tenants/{id}/usage.json`.

`static/chart.js` fetches it every 2 s with the session cookie. It is the admin API's own
tenant usage (`gateway.admin.service.usage.tenant_usage`): the tenant's blocks now, its
samples of the last minutes from the gateway's in-memory usage history (blocks at each sample,
and the hit ratio of the prompt tokens since the sample before) and what the window adds up to.
A tenant-admin asking for another tenant's feed gets the same 404 as for a missing tenant.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query

from gateway.admin.service import usage as usage_service
from gateway.console.pages import CallerDep, ConsoleRoute
from gateway.http.deps import StateDep

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)


@router.get("/tenants/{tenant_id}/usage.json")
def usage_feed(
    tenant_id: uuid.UUID,
    caller: CallerDep,
    state: StateDep,
    window_s: Annotated[int, Query(ge=1, le=86_400)] = usage_service.DEFAULT_WINDOW_S,
) -> usage_service.TenantUsage:
    """The tenant's usage now and over the window (404 if the caller may not see it)."""
    return usage_service.tenant_usage(state, caller, tenant_id, window_s)
