"""A tenant's API keys under /admin/api/tenants/{tenant_id}/keys: list, create, revoke, rotate.

An admin manages every tenant's keys, a tenant-admin its own tenant's; a new key's secret is in
the answer that creates it and nowhere else (gateway/admin/service/keys.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body, Path

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import CreatedKeyOut, KeyCreate, KeyOut, KeyRotate
from gateway.admin.service import keys
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

router = APIRouter(prefix="/admin/api/tenants", tags=["admin: keys"], responses=ADMIN_RESPONSES)

KeyId = Annotated[str, Path(min_length=1, max_length=32, description="The key's public id")]


@router.get("/{tenant_id}/keys")
def list_keys(tenant_id: uuid.UUID, caller: AdminDep, state: StateDep) -> list[KeyOut]:
    """The tenant's keys, oldest first, each with its state; never a secret."""
    return keys.list_keys(state, caller, tenant_id)


@router.post("/{tenant_id}/keys", status_code=201)
def create_key(
    tenant_id: uuid.UUID, body: Annotated[KeyCreate, Body()], caller: AdminDep, state: StateDep
) -> CreatedKeyOut:
    """Create a key; the answer holds the full key, shown this once."""
    return keys.create_key(state, caller, tenant_id, body)


@router.post("/{tenant_id}/keys/{key_id}/revoke")
def revoke_key(tenant_id: uuid.UUID, key_id: KeyId, caller: AdminDep, state: StateDep) -> KeyOut:
    """Revoke a key: the next request with it is refused (a key may revoke itself)."""
    return keys.revoke_key(state, caller, tenant_id, key_id)


@router.post("/{tenant_id}/keys/{key_id}/rotate", status_code=201)
def rotate_key(
    tenant_id: uuid.UUID,
    key_id: KeyId,
    body: Annotated[KeyRotate, Body()],
    caller: AdminDep,
    state: StateDep,
) -> CreatedKeyOut:
    """Issue a successor (shown this once); the old key works for `grace_seconds` more."""
    return keys.rotate_key(state, caller, tenant_id, key_id, body)
