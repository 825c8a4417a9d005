"""Who pays for a block, how many blocks they may hold, and the typed refusals."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.cache.scope import CacheScope, Public


class PublicOwner(enum.Enum):
    """The owner of blocks cached under a `Public` scope: the public budget, not a tenant."""

    PUBLIC = "public"


PUBLIC_OWNER = PublicOwner.PUBLIC
# Who pays for a block: a tenant (by id) or the public budget; see `owner_of`.
Owner = str | PublicOwner


def owner_of(scope: CacheScope, tenant_id: str) -> Owner:
    """Who pays for a block of `tenant_id`'s request that carries `scope`.

    A public block is shared by every tenant, so the public budget pays for it; any other
    block is the requesting tenant's.
    """
    return PUBLIC_OWNER if isinstance(scope, Public) else tenant_id


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """A quota (max blocks held, active + cached) and a reservation.

    The reservation is how many of the owner's blocks other owners' pressure can never evict:
    while an owner holds no more than its reservation, none of its cached blocks is a victim
    of someone else's allocation.
    """

    quota_blocks: int
    reserved_blocks: int = 0
    # The owner's bytes in a second KV tier, and those no other owner's offloads may evict
    # (None: as many bytes as `quota_blocks` of KV take).
    tier_quota_bytes: int | None = None
    tier_reserved_bytes: int = 0

    def __post_init__(self) -> None:
        if self.quota_blocks < 0:
            raise ValueError("quota_blocks must not be negative")
        if not 0 <= self.reserved_blocks <= self.quota_blocks:
            raise ValueError("reserved_blocks must be between 0 and quota_blocks")
        if self.tier_quota_bytes is not None and self.tier_quota_bytes < 0:
            raise ValueError("tier_quota_bytes must not be negative")
        if self.tier_reserved_bytes < 0 or (
            self.tier_quota_bytes is not None and self.tier_reserved_bytes > self.tier_quota_bytes
        ):
            raise ValueError("tier_reserved_bytes must be between 0 and tier_quota_bytes")


@dataclass(frozen=True, slots=True)
class QuotaExceeded:
    """The owner would hold more than its quota even after evicting its own cached blocks."""

    owner: Owner
    needed_blocks: int
    quota_blocks: int
    active_blocks: int

    def __str__(self) -> str:
        return (
            f"cache quota exceeded for {describe_owner(self.owner)}: needs {self.needed_blocks} "
            f"more blocks, {self.active_blocks} in use, quota {self.quota_blocks}"
        )


@dataclass(frozen=True, slots=True)
class ShareExceeded:
    """The pool is full and the owner would hold more than it leaves the owner beside what
    other owners hold of their reservations: the owner's own limit, not a crowded pool.

    `share_blocks` is the pool less the blocks other owners hold within their reservations;
    `active_blocks` are the owner's blocks in use (its idle ones it could evict itself).
    """

    owner: Owner
    needed_blocks: int
    share_blocks: int
    active_blocks: int

    def __str__(self) -> str:
        return (
            f"cache share exceeded for {describe_owner(self.owner)}: needs "
            f"{self.needed_blocks} more blocks, {self.active_blocks} in use, and the pool "
            f"leaves it {self.share_blocks} beside other owners' reservations"
        )


@dataclass(frozen=True, slots=True)
class PoolExhausted:
    """The pool has too few free or evictable blocks, whatever the quotas say."""

    needed_blocks: int
    available_blocks: int

    def __str__(self) -> str:
        return (
            f"KV block pool exhausted: needs {self.needed_blocks} blocks, "
            f"{self.available_blocks} free or evictable"
        )


Refusal = QuotaExceeded | ShareExceeded | PoolExhausted


def describe_owner(owner: Owner) -> str:
    """A human-readable name for an owner."""
    return "the public budget" if owner is PUBLIC_OWNER else f"tenant {owner!r}"
