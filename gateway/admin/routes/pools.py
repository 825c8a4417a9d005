"""KV pools under /admin/api/pools: each served model's pool, its workers and who holds what.

An admin sees everything; a tenant-admin sees each pool with its own tenant's row only
(gateway/admin/service/pools.py).
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import PoolsOut
from gateway.admin.service import pools
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

router = APIRouter(prefix="/admin/api/pools", tags=["admin: pools"], responses=ADMIN_RESPONSES)


@router.get("")
def list_pools(caller: AdminDep, state: StateDep) -> PoolsOut:
    """Each model's KV pool: its workers, its blocks and each owner's (a tenant-admin: its own)."""
    return pools.pools_view(state, caller)
