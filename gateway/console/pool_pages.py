"""The pools page: each model's KV pool, its engine workers and who holds its blocks.

One section per model: whether it is served now, its blocks (free of total), its workers (in
routing or not, requests in flight, load, published keys, last error) and a table of the
public budget and the tenants holding or having used blocks there, each with active, cached,
reserved and quota blocks and its hit ratio since the server started. It is the admin API's
own answer (`gateway.admin.service.pools.pools_view`), so a tenant-admin who opens it sees
each pool with its own tenant's row only, and no worker; the main navigation links it for
admins (a tenant-admin's own tenant page shows its usage per pool).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.admin.service import pools as pool_service
from gateway.console.pages import CallerDep, ConsoleRoute, render
from gateway.http.deps import StateDep

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)


@router.get("/pools")
def pools_page(request: Request, caller: CallerDep, state: StateDep) -> Response:
    """Every model's pool, as the operator may see it."""
    return render(
        request,
        "pools.html",
        title="Pools",
        listed=pool_service.pools_view(state, caller),
        block_size=state.settings.block_size,
    )
