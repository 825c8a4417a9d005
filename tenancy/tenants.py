"""Tenants: create, look up, change quotas, sharing and scheduling weight, suspend, delete.

A tenant has two cache budgets: its quota and reservation in the KV pool, in blocks (checked
against the pool a server recorded), and in the second KV tier, in bytes. A tier quota left
unset (NULL) is the default, the pool quota's bytes, which the engine resolves with its model's
bytes per block (`cache_quota_blocks` x bytes per block); a tier reservation left unset is none
(0), as a pool reservation is by default. Deleting a tenant shreds its data key
(tenancy/seal_keys.py) in the same transaction.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenancy.deployment import Pool, recorded_pool
from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.models import SCHEDULING_WEIGHT_RANGE, SHARING_MODES, ApiKey, Tenant, utcnow
from tenancy.seal_keys import shred_tenant_key

DEFAULT_QUOTA_BLOCKS = 1024
_SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
# Metrics label the public budget's blocks owner="public"; no tenant may share that name.
RESERVED_SLUGS = frozenset({"public"})
# The largest byte count a tier quota column holds (BIGINT).
MAX_TIER_BYTES = (1 << 63) - 1


class Unchanged(enum.Enum):
    """A field a change leaves as it is, where None means something (a default)."""

    UNCHANGED = "unchanged"


UNCHANGED = Unchanged.UNCHANGED


@dataclass(frozen=True, slots=True)
class TenantLimits:
    # None: DEFAULT_QUOTA_BLOCKS, capped at the KV pool a server recorded.
    cache_quota_blocks: int | None = None
    cache_reservation_blocks: int = 0
    requests_per_minute: int = 600
    tokens_per_minute: int = 1_000_000
    max_concurrent: int = 16
    # Against other tenants with work, the tenant's share of the engine's service is in
    # proportion to it; equal weights share equally.
    scheduling_weight: float = 1.0
    # Bytes in the second KV tier; None: the default (the pool quota's bytes; no reservation).
    tier_quota_bytes: int | None = None
    tier_reservation_bytes: int | None = None


def weight_text(weight: float) -> str:
    """A scheduling weight as people write it, exactly: the shortest decimal that reads back as
    the same float (`2.5`, `100.0001`, `1`), never rounded for display."""
    return repr(weight).removesuffix(".0")


def check_scheduling_weight(weight: float) -> float:
    """`weight` if it is a scheduling weight a tenant may have, else `InvalidInput`."""
    low, high = SCHEDULING_WEIGHT_RANGE
    if not low <= weight <= high:  # NaN fails too
        raise InvalidInput(
            f"scheduling weight must be between {weight_text(low)} and {weight_text(high)} "
            f"(got {weight_text(weight)})",
            "scheduling_weight",
        )
    return weight


def check_quota(
    session: Session,
    quota_blocks: int,
    reservation_blocks: int,
    current: Tenant | None = None,
) -> Pool | None:
    """Check a new (or `current` tenant's new) quota and reservation, against the pool when a
    server recorded one: the quota fits in the pool and all tenants' reservations together
    fit in it too. Only what grows is held to the pool, so after a server starts with a
    smaller pool, lowering a quota or a reservation is always allowed.

    Returns the pool checked against (None: no server has recorded one yet).
    """
    if quota_blocks < 0:
        raise InvalidInput("cache quota must not be negative", "cache_quota_blocks")
    if reservation_blocks < 0:
        raise InvalidInput("cache reservation must not be negative", "cache_reservation_blocks")
    if reservation_blocks > quota_blocks:
        raise InvalidInput(
            f"cache reservation ({reservation_blocks}) must not exceed the quota ({quota_blocks})",
            "cache_reservation_blocks",
        )
    pool = recorded_pool(session, for_update=True)
    if pool is None:
        return None
    old_quota, old_reservation = (
        (0, 0)
        if current is None
        else (current.cache_quota_blocks, current.cache_reservation_blocks)
    )
    if quota_blocks > max(pool.blocks, old_quota):
        raise InvalidInput(
            f"cache quota ({quota_blocks} blocks) is larger than the KV pool ({pool.blocks} "
            "blocks, as a server recorded it)",
            "cache_quota_blocks",
        )
    others = select(func.coalesce(func.sum(Tenant.cache_reservation_blocks), 0)).where(
        Tenant.status != "deleted"
    )
    if current is not None:
        others = others.where(Tenant.id != current.id)
    reserved_by_others = session.scalar(others) or 0
    total = reserved_by_others + reservation_blocks
    if reservation_blocks > old_reservation and total > pool.blocks:
        raise InvalidInput(
            f"cache reservations would total {total} blocks, "
            f"more than the KV pool's {pool.blocks} (other tenants reserve {reserved_by_others})",
            "cache_reservation_blocks",
        )
    return pool


def check_tier_quota(quota_bytes: int | None, reservation_bytes: int | None) -> None:
    """Refuse (`InvalidInput`) a tier quota or reservation below zero or beyond a BIGINT, or a
    reservation above the quota when both are set (None is the default, always allowed)."""
    given = {"tier_quota_bytes": quota_bytes, "tier_reservation_bytes": reservation_bytes}
    for name, value in given.items():
        what = name.removesuffix("_bytes").replace("_", " ")
        if value is not None and not 0 <= value <= MAX_TIER_BYTES:
            raise InvalidInput(f"{what} must be between 0 and {MAX_TIER_BYTES} bytes", name)
    if quota_bytes is None or reservation_bytes is None:
        return
    if reservation_bytes > quota_bytes:
        raise InvalidInput(
            f"tier reservation ({reservation_bytes} bytes) must not exceed the tier quota "
            f"({quota_bytes} bytes)",
            "tier_reservation_bytes",
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
    if slug in RESERVED_SLUGS:
        raise InvalidInput(f"tenant slug {slug!r} is reserved (it names the public budget)", "slug")
    if sharing_mode not in SHARING_MODES:
        raise InvalidInput(f"sharing mode must be one of {', '.join(SHARING_MODES)}", "sharing")
    quota = limits.cache_quota_blocks
    if quota is None:
        pool = recorded_pool(session)
        quota = DEFAULT_QUOTA_BLOCKS if pool is None else min(DEFAULT_QUOTA_BLOCKS, pool.blocks)
    check_quota(session, quota, limits.cache_reservation_blocks)
    check_tier_quota(limits.tier_quota_bytes, limits.tier_reservation_bytes)
    for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        if getattr(limits, name) < 0:
            raise InvalidInput(f"{name.replace('_', ' ')} must not be negative", name)
    check_scheduling_weight(limits.scheduling_weight)
    if session.scalar(select(Tenant.id).where(Tenant.slug == slug)) is not None:
        raise Conflict(f"a tenant with slug {slug!r} already exists")
    tenant = Tenant(
        slug=slug,
        display_name=display_name or slug,
        sharing_mode=sharing_mode,
        may_use_public_prefixes=may_use_public_prefixes,
        cache_quota_blocks=quota,
        cache_reservation_blocks=limits.cache_reservation_blocks,
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent=limits.max_concurrent,
        scheduling_weight=limits.scheduling_weight,
        tier_quota_bytes=limits.tier_quota_bytes,
        tier_reservation_bytes=limits.tier_reservation_bytes,
    )
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as error:  # a concurrent create won the race
        session.rollback()
        raise Conflict(f"a tenant with slug {slug!r} already exists") from error
    return tenant


def tenant_settings(row: Tenant) -> dict[str, object]:
    """What an operator sets on a tenant, by field name (for listings and audit events)."""
    return {
        "slug": row.slug,
        "display_name": row.display_name,
        "status": row.status,
        "sharing_mode": row.sharing_mode,
        "may_use_public_prefixes": row.may_use_public_prefixes,
        "cache_quota_blocks": row.cache_quota_blocks,
        "cache_reservation_blocks": row.cache_reservation_blocks,
        "requests_per_minute": row.requests_per_minute,
        "tokens_per_minute": row.tokens_per_minute,
        "max_concurrent": row.max_concurrent,
        "scheduling_weight": row.scheduling_weight,
        "tier_quota_bytes": row.tier_quota_bytes,
        "tier_reservation_bytes": row.tier_reservation_bytes,
    }


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


def search_tenants(
    session: Session, text: str = "", limit: int = 50, offset: int = 0
) -> tuple[list[Tenant], int]:
    """One page of live tenants whose slug or display name contains `text` (any case), by
    slug, and how many match in all."""
    query = select(Tenant).where(Tenant.status != "deleted")
    if text:
        escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = f"%{escaped}%"
        query = query.where(
            func.lower(Tenant.slug).like(pattern, escape="\\")
            | func.lower(Tenant.display_name).like(pattern, escape="\\")
        )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    page = session.scalars(query.order_by(Tenant.slug).limit(limit).offset(offset))
    return list(page), total


@dataclass(frozen=True, slots=True)
class TenantChanges:
    """A partial update of a tenant's settings: None leaves a field as it is."""

    display_name: str | None = None
    sharing_mode: str | None = None
    may_use_public_prefixes: bool | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    scheduling_weight: float | None = None


def update_tenant(session: Session, slug: str, changes: TenantChanges) -> Tenant:
    """Change a tenant's display name, sharing mode, public-prefix use, request limits or
    scheduling weight."""
    tenant = get_tenant(session, slug)
    if changes.display_name is not None:
        if not changes.display_name.strip():
            raise InvalidInput("display name must not be empty", "display_name")
        tenant.display_name = changes.display_name
    if changes.sharing_mode is not None:
        if changes.sharing_mode not in SHARING_MODES:
            raise InvalidInput(
                f"sharing mode must be one of {', '.join(SHARING_MODES)}", "sharing_mode"
            )
        tenant.sharing_mode = changes.sharing_mode
    if changes.may_use_public_prefixes is not None:
        tenant.may_use_public_prefixes = changes.may_use_public_prefixes
    for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        value = getattr(changes, name)
        if value is None:
            continue
        if value < 0:
            raise InvalidInput(f"{name.replace('_', ' ')} must not be negative", name)
        setattr(tenant, name, value)
    if changes.scheduling_weight is not None:
        tenant.scheduling_weight = check_scheduling_weight(changes.scheduling_weight)
    session.flush()
    return tenant


def set_scheduling_weight(session: Session, slug: str, weight: float) -> Tenant:
    """Change a tenant's scheduling weight; its next request carries it to the engine."""
    return update_tenant(session, slug, TenantChanges(scheduling_weight=weight))


def set_quota(
    session: Session,
    slug: str,
    quota_blocks: int | None = None,
    reservation_blocks: int | None = None,
    tier_quota_bytes: int | Unchanged | None = UNCHANGED,
    tier_reservation_bytes: int | Unchanged | None = UNCHANGED,
) -> Tenant:
    """Change a tenant's cache quota, reservation, tier quota, tier reservation or several;
    what is not given stays (a tier field given as None goes back to the default)."""
    if (quota_blocks, reservation_blocks) == (None, None) and (
        tier_quota_bytes is UNCHANGED and tier_reservation_bytes is UNCHANGED
    ):
        raise InvalidInput(
            "give a new quota, a new reservation, a new tier quota or tier reservation",
            "cache_quota_blocks",
        )
    tenant = get_tenant(session, slug)
    quota = tenant.cache_quota_blocks if quota_blocks is None else quota_blocks
    reservation = (
        tenant.cache_reservation_blocks if reservation_blocks is None else reservation_blocks
    )
    tier_quota = (
        tenant.tier_quota_bytes if isinstance(tier_quota_bytes, Unchanged) else tier_quota_bytes
    )
    tier_reservation = (
        tenant.tier_reservation_bytes
        if isinstance(tier_reservation_bytes, Unchanged)
        else tier_reservation_bytes
    )
    check_tier_quota(tier_quota, tier_reservation)
    check_quota(session, quota, reservation, tenant)
    tenant.cache_quota_blocks = quota
    tenant.cache_reservation_blocks = reservation
    tenant.tier_quota_bytes = tier_quota
    tenant.tier_reservation_bytes = tier_reservation
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


@dataclass(frozen=True, slots=True)
class DeletedTenant:
    """A tenant just deleted, and whether a data key of its was shredded with it."""

    tenant: Tenant
    data_key_shredded: bool  # False: it never had one (nothing reached the second tier)


def delete_tenant(session: Session, slug: str) -> DeletedTenant:
    """Mark a tenant deleted, revoke all its keys and shred its data key, so whatever of it a
    second tier holds is unreadable from the commit on; its audit trail stays."""
    tenant = get_tenant(session, slug)
    tenant.status = "deleted"
    now = utcnow()
    session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    # Flushed first: the row's lock makes a data key being made at this moment commit before
    # the shredding reads (or see the tenant deleted and make none).
    session.flush()
    return DeletedTenant(tenant, shred_tenant_key(session, tenant.id))
