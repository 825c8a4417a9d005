"""The data behind a tenant page's live parts: `GET /admin/tenants/{id}/usage.json`.

`static/chart.js` fetches it every 2 s with the session cookie. It is the admin API's own
tenant usage (`gateway.admin.service.usage.tenant_usage`): the tenant's blocks now, its
samples of the last minutes from the gateway's in-memory usage history (blocks at each sample,
and the hit ratio of the prompt tokens since the sample before) and what the window adds up to.
To it the console adds the server's time of the answer (the chart's "now", where its lines end
at the blocks, quota and reservation of now: a sample can be up to an interval older than a
quota just saved) and when each of the tenant's keys was last used (the admin service's key
list), as the keys table shows it. A tenant-admin asking for another tenant's feed gets the
same 404 as for a missing tenant.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from gateway.admin.service import keys as key_service
from gateway.admin.service import usage as usage_service
from gateway.console.pages import CallerDep, ConsoleRoute, format_time
from gateway.http.deps import StateDep

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)


class KeyUse(BaseModel):
    """When a key was last used, as the keys table shows it ("—" for never)."""

    key_id: str
    last_used: str


class LiveUsage(usage_service.TenantUsage):
    """The tenant's usage, the server's time of it, and its keys' last use."""

    now: datetime
    keys: list[KeyUse]


@router.get("/tenants/{tenant_id}/usage.json")
def usage_feed(
    tenant_id: uuid.UUID,
    caller: CallerDep,
    state: StateDep,
    window_s: Annotated[int, Query(ge=1, le=86_400)] = usage_service.DEFAULT_WINDOW_S,
) -> LiveUsage:
    """The tenant's usage now and over the window (404 if the caller may not see it)."""
    usage = usage_service.tenant_usage(state, caller, tenant_id, window_s)
    keys = key_service.list_keys(state, caller, tenant_id)
    return LiveUsage(
        **dict(usage),
        now=datetime.now(UTC),
        keys=[KeyUse(key_id=key.key_id, last_used=format_time(key.last_used_at)) for key in keys],
    )
