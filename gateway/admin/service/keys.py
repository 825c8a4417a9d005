"""A tenant's API keys: list, create, revoke, rotate.

An admin manages every tenant's keys; a tenant-admin (key or operator) manages its own tenant's
keys, inference and tenant-admin alike, and any other tenant is a 404. A new key's secret is in
the answer that creates it and nowhere else: listings and audit events carry its public key id.
Revocation and rotation apply to this process before the answer (cached key checks are dropped),
so the very next request with a revoked key is refused; other gateways follow within a poll.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy.orm import Session

from gateway.admin.audited_change import Action, Changed, apply_change
from gateway.admin.callers import AdminCaller, visible_tenant
from gateway.admin.outputs import key_out
from gateway.admin.schemas import CreatedKeyOut, KeyCreate, KeyOut, KeyRotate
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import api_keys
from tenancy.api_keys import CreatedKey
from tenancy.models import ApiKey, Tenant, utcnow

# What a key change returns: the key it changed, or a new key with its secret.
Issued = TypeVar("Issued", ApiKey, CreatedKey)


def list_keys(state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID) -> list[KeyOut]:
    """The tenant's keys, oldest first, each with its state; never a secret."""
    with state.store.transaction() as session:
        visible_tenant(session, caller, tenant_id)
        now = utcnow()
        return [key_out(key, now) for key in api_keys.list_keys(session, tenant_id)]


def create_key(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, body: KeyCreate
) -> CreatedKeyOut:
    """Create a key; the answer holds the full key, shown this once."""
    expires_at = body.expires_at

    def change(session: Session, tenant: Tenant) -> CreatedKey:
        if expires_at is not None and expires_at <= utcnow():
            raise APIError.invalid("expires_at must be in the future", "expires_at")
        return api_keys.create_key(
            session, tenant, body.name, state.store.key_secret, body.role, expires_at
        )

    action = Action("api_key.create", "api_key", body.name, str(tenant_id))
    return _issued(_change_key(state, caller, tenant_id, action, None, change))


def revoke_key(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, key_id: str
) -> KeyOut:
    """Revoke a key: the next request with it is refused (a key may revoke itself)."""

    def change(session: Session, tenant: Tenant) -> ApiKey:
        return api_keys.revoke_key(session, tenant.id, key_id)

    action = Action("api_key.revoke", "api_key", key_id, str(tenant_id))
    return key_out(_change_key(state, caller, tenant_id, action, key_id, change))


def rotate_key(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, key_id: str, body: KeyRotate
) -> CreatedKeyOut:
    """Issue a successor (shown this once); the old key works for `grace_seconds` more."""

    def change(session: Session, tenant: Tenant) -> CreatedKey:
        old = api_keys.get_key(session, tenant.id, key_id)
        current = api_keys.key_state(old, utcnow())
        if current != "active":
            # Rotating again would move the old key's end of grace, even revive an expired key.
            raise APIError.conflict(f"key {key_id!r} is {current}; only an active key rotates")
        grace = timedelta(seconds=body.grace_seconds)
        return api_keys.rotate_key(session, tenant, key_id, state.store.key_secret, grace)

    action = Action("api_key.rotate", "api_key", key_id, str(tenant_id))
    return _issued(_change_key(state, caller, tenant_id, action, key_id, change))


def _change_key(
    state: GatewayState,
    caller: AdminCaller,
    tenant_id: uuid.UUID,
    action: Action,
    key_id: str | None,
    change: Callable[[Session, Tenant], Issued],
) -> Issued:
    """Apply `change` to a tenant the caller sees, audited with the key before and after."""

    def audited(session: Session) -> Changed[Issued]:
        tenant = visible_tenant(session, caller, tenant_id)
        named = None if key_id is None else api_keys.get_key(session, tenant.id, key_id)
        before = None if named is None else _audit_view(named)
        result = change(session, tenant)
        issued = result.key if isinstance(result, CreatedKey) else None
        if named is None:
            assert issued is not None  # a change that names no key creates one
            return Changed(result, str(tenant_id), None, _audit_view(issued))
        after = _audit_view(named)  # the same row, as the change left it
        if issued is not None:
            after["successor_key_id"] = issued.key_id
        return Changed(result, str(tenant_id), before, after)

    return apply_change(state, caller, action, audited)


def _issued(created: CreatedKey) -> CreatedKeyOut:
    return CreatedKeyOut(**key_out(created.key).model_dump(), key=created.secret)


def _audit_view(key: ApiKey) -> dict[str, object]:
    """The key as its audit events record it: public id and settings, never secret or hash."""
    return {
        "key_id": key.key_id,
        "name": key.name,
        "role": key.role,
        "state": api_keys.key_state(key, utcnow()),
        "expires_at": _iso(key.expires_at),
        "revoked_at": _iso(key.revoked_at),
        "grace_until": _iso(key.grace_until),
    }


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()
