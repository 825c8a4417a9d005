"""API keys: create (shown once), list, revoke, rotate with a grace period, authenticate."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.key_format import MalformedKey, hash_secret, new_key, parse_key, secret_matches
from tenancy.models import KEY_ROLES, ApiKey, Tenant, utcnow

MAX_LIVE_KEYS = 1000  # per tenant: one tenant-admin cannot fill the table


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A new key: `secret` is the full key string, to be shown exactly once."""

    key: ApiKey
    secret: str


class AuthFailure(enum.Enum):
    MALFORMED = "malformed"
    UNKNOWN = "unknown"
    WRONG_SECRET = "wrong_secret"
    REVOKED = "revoked"
    EXPIRED = "expired"
    TENANT_SUSPENDED = "tenant_suspended"
    TENANT_DELETED = "tenant_deleted"


@dataclass(frozen=True, slots=True)
class VerifiedKey:
    """A key that passed every check, and the tenant it speaks for."""

    tenant_id: uuid.UUID
    tenant_slug: str
    key_id: str
    role: str


def create_key(
    session: Session,
    tenant: Tenant,
    name: str,
    server_secret: str,
    role: str = "inference",
    expires_at: datetime | None = None,
) -> CreatedKey:
    if role not in KEY_ROLES:
        raise InvalidInput(f"role must be one of {', '.join(KEY_ROLES)}", "role")
    if tenant.status == "deleted":
        raise NotFound(f"no tenant {tenant.slug!r}")
    live = select(func.count()).where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
    if (session.scalar(live) or 0) >= MAX_LIVE_KEYS:
        raise Conflict(
            f"tenant {tenant.slug!r} already has {MAX_LIVE_KEYS} keys that are not revoked; "
            "revoke some first"
        )
    secret, parsed = new_key()
    key = ApiKey(
        tenant_id=tenant.id,
        name=name,
        key_id=parsed.key_id,
        secret_hash=hash_secret(parsed.secret, server_secret),
        role=role,
        expires_at=expires_at,
    )
    session.add(key)
    session.flush()
    return CreatedKey(key, secret)


def list_keys(session: Session, tenant_id: uuid.UUID) -> list[ApiKey]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
    return list(session.scalars(query))


def get_key(session: Session, tenant_id: uuid.UUID, key_id: str) -> ApiKey:
    """A tenant's key by its public id; another tenant's key is simply not found."""
    key = session.scalar(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.key_id == key_id)
    )
    if key is None:
        raise NotFound(f"no key {key_id!r} for this tenant")
    return key


def revoke_key(session: Session, tenant_id: uuid.UUID, key_id: str) -> ApiKey:
    key = get_key(session, tenant_id, key_id)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def rotate_key(
    session: Session,
    tenant: Tenant,
    key_id: str,
    server_secret: str,
    grace: timedelta = timedelta(hours=24),
) -> CreatedKey:
    """Issue a successor; the old key keeps working for `grace`, then stops."""
    if grace < timedelta(0):
        raise InvalidInput("grace period must not be negative", "grace")
    old = get_key(session, tenant.id, key_id)
    if old.revoked_at is not None:
        raise InvalidInput(f"key {key_id!r} is revoked and cannot be rotated", "key_id")
    created = create_key(session, tenant, old.name, server_secret, old.role, old.expires_at)
    created.key.rotated_from_id = old.id
    old.grace_until = utcnow() + grace
    session.flush()
    return created


def authenticate(
    session: Session, presented: str, server_secret: str, now: datetime | None = None
) -> VerifiedKey | AuthFailure:
    """Check a presented key: shape, checksum, lookup by key id, constant-time secret compare."""
    try:
        parsed = parse_key(presented)
    except MalformedKey:
        return AuthFailure.MALFORMED
    row = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_id == parsed.key_id)
    ).first()
    if row is None:
        # Spend the same work as a real comparison, so timing does not reveal key ids.
        secret_matches(parsed.secret, "0" * 64, server_secret)
        return AuthFailure.UNKNOWN
    key, tenant = row
    if not secret_matches(parsed.secret, key.secret_hash, server_secret):
        return AuthFailure.WRONG_SECRET
    now = now or utcnow()
    state = key_state(key, now)
    if state == "revoked":
        return AuthFailure.REVOKED
    if state == "expired":
        return AuthFailure.EXPIRED
    if tenant.status == "suspended":
        return AuthFailure.TENANT_SUSPENDED
    if tenant.status == "deleted":
        return AuthFailure.TENANT_DELETED
    key.last_used_at = now
    return VerifiedKey(tenant.id, tenant.slug, key.key_id, key.role)


def key_state(key: ApiKey, now: datetime) -> str:
    """What presenting `key` does at `now`: `revoked`, `expired` (past its expiry or the end
    of its rotation's grace period), `rotating` (in that grace period) or `active`."""
    if key.revoked_at is not None:
        return "revoked"
    ends = [moment for moment in (key.expires_at, key.grace_until) if moment is not None]
    if any(end <= now for end in ends):
        return "expired"
    return "rotating" if key.grace_until is not None else "active"
