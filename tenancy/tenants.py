"""Tenants: create, look up, change quotas and sharing, suspend, delete."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.models import SHARING_MODES, ApiKey, Tenant, utcnow

_SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    cache_quota_blocks: int = 1024
    cache_reservation_blocks: int = 0
    requests_per_minute: int = 600
    tokens_per_minute: int = 1_000_000
    max_concurrent: int = 16


def check_quota(quota_blocks: int, reservation_blocks: int) -> None:
    if quota_blocks < 0:
        raise InvalidInput("cache quota must not be negative", "cache_quota_blocks")
    if reservation_blocks < 0:
        raise InvalidInput("cache reservation must not be negative", "cache_reservation_blocks")
    if reservation_blocks > quota_blocks:
        raise InvalidInput(
            f"cache reservation ({reservation_blocks}) must not exceed the quota ({quota_blocks})",
            "cache_reservation_blocks",
        )


def create_tenant(
    session: Session,
    slug: str,
    display_name: str | None = None,
    sharing_mode: str = "user",
    limits: TenantLimits | None = None,
    may_use_public_prefixes: bool = True,
) -> Tenant:
    """Create an active tenant; slugs are lowercase letters, digits and dashes."""
    limits = limits or TenantLimits()
    if not _SLUG.match(slug):
        raise InvalidInput(
            f"invalid tenant slug {slug!r}: use 1-63 lowercase letters, digits and dashes", "slug"
        )
    if sharing_mode not in SHARING_MODES:
        raise InvalidInput(f"sharing mode must be one of {', '.join(SHARING_MODES)}", "sharing")
    check_quota(limits.cache_quota_blocks, limits.cache_reservation_blocks)
    for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        if getattr(limits, name) < 0:
            raise InvalidInput(f"{name.replace('_', ' ')} must not be negative", name)
    if session.scalar(select(Tenant.id).where(Tenant.slug == slug)) is not None:
        raise Conflict(f"a tenant with slug {slug!r} already exists")
    tenant = Tenant(
        slug=slug,
        display_name=display_name or slug,
        sharing_mode=sharing_mode,
        may_use_public_prefixes=may_use_public_prefixes,
        cache_quota_blocks=limits.cache_quota_blocks,
        cache_reservation_blocks=limits.cache_reservation_blocks,
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent=limits.max_concurrent,
    )
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as error:  # a concurrent create won the race
        session.rollback()
        raise Conflict(f"a tenant with slug {slug!r} already exists") from error
    return tenant


def get_tenant(session: Session, slug: str, include_deleted: bool = False) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.slug == slug))
    if tenant is None or (tenant.status == "deleted" and not include_deleted):
        raise NotFound(f"no tenant {slug!r}")
    return tenant


def get_tenant_by_id(session: Session, tenant_id: uuid.UUID) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None or tenant.status == "deleted":
        raise NotFound(f"no tenant with id {tenant_id}")
    return tenant


def list_tenants(session: Session, include_deleted: bool = False) -> list[Tenant]:
    query = select(Tenant).order_by(Tenant.slug)
    if not include_deleted:
        query = query.where(Tenant.status != "deleted")
    return list(session.scalars(query))


def set_quota(session: Session, slug: str, quota_blocks: int, reservation_blocks: int) -> Tenant:
    tenant = get_tenant(session, slug)
    check_quota(quota_blocks, reservation_blocks)
    tenant.cache_quota_blocks = quota_blocks
    tenant.cache_reservation_blocks = reservation_blocks
    session.flush()
    return tenant


def set_sharing(session: Session, slug: str, sharing_mode: str) -> Tenant:
    if sharing_mode not in SHARING_MODES:
        raise InvalidInput(f"sharing mode must be one of {', '.join(SHARING_MODES)}", "sharing")
    tenant = get_tenant(session, slug)
    tenant.sharing_mode = sharing_mode
    session.flush()
    return tenant


def set_status(session: Session, slug: str, status: str) -> Tenant:
    """Suspend or reactivate a tenant; deletion goes through `delete_tenant`."""
    if status not in ("active", "suspended"):
        raise InvalidInput("status must be active or suspended", "status")
    tenant = get_tenant(session, slug)
    tenant.status = status
    session.flush()
    return tenant


def delete_tenant(session: Session, slug: str) -> Tenant:
    """Mark a tenant deleted and revoke all its keys; its audit trail stays."""
    tenant = get_tenant(session, slug)
    tenant.status = "deleted"
    now = utcnow()
    session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    session.flush()
    return tenant
