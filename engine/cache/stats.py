"""Snapshots of the KV cache: per-owner blocks and reuse, pool-wide counters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.quotas import OwnerCounters
from engine.cache.tier.counters import TierOwnerStats
from engine.cache.tier.store import TierBudget


@dataclass(frozen=True, slots=True)
class OwnerStats:
    """One owner's blocks (in use, and idle but cached), its budget and its running totals."""

    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    counters: OwnerCounters = field(default_factory=OwnerCounters)
    # In the second tier: what the owner holds in the store (every worker's, on a shared one)
    # and its budget there, then this worker's traffic for it.
    tier_bytes: int = 0
    tier_entries: int = 0
    tier_quota_bytes: int = 0
    tier_reserved_bytes: int = 0
    tier_offloads: int = 0
    tier_loads: int = 0
    tier_loaded_bytes: int = 0
    tier_misses: int = 0
    tier_drops: int = 0
    tier_evicted: int = 0
    tier_purged: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The whole cache at one moment: the pool's counters and every owner's stats."""

    num_blocks: int
    free_blocks: int
    cached_keys: int
    blocks_zeroed: int
    zero_operations: int
    collisions: int
    peak_active_blocks: int
    owners: dict[Owner, OwnerStats]
    # The second tier: "disk", "redis" (shared by every worker), or None; its capacity.
    tier_kind: str | None = None
    tier_capacity_bytes: int = 0

    @property
    def evicted_blocks(self) -> int:
        """Evictions of every owner, own and pressure."""
        return sum(owner.counters.evicted_blocks for owner in self.owners.values())

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the engine was asked for: its tenants' (the public budget's counters
        hold the same tokens again, those in public blocks)."""
        return sum(
            stats.counters.prompt_tokens
            for owner, stats in self.owners.items()
            if owner is not PUBLIC_OWNER
        )


def snapshot(cache: KVCacheManager) -> CacheStats:
    """The cache as it is now: each owner's blocks, budget and reuse, and the pool's counters."""
    pool = cache.pool
    tier = None if cache.tier is None else cache.tier.tier.snapshot()
    owners = {}
    for owner in cache.owners() | (set() if tier is None else set(tier.owners)):
        budget = cache.budget(owner)
        owned, idle = pool.owned(owner), pool.idle_count(owner)
        stats = OwnerStats(
            active_blocks=owned - idle,
            cached_blocks=idle,
            reserved_blocks=budget.reserved_blocks,
            quota_blocks=budget.quota_blocks,
            counters=cache.counters(owner),
        )
        if tier is not None:
            stats = _with_tier(stats, tier.owners.get(owner), cache.tier_budget(owner))
        owners[owner] = stats
    return CacheStats(
        num_blocks=pool.num_blocks,
        free_blocks=pool.num_available,
        cached_keys=len(cache.prefix_cache),
        blocks_zeroed=pool.blocks_zeroed,
        zero_operations=pool.zero_operations,
        collisions=cache.prefix_cache.collisions,
        peak_active_blocks=cache.peak_active_blocks,
        owners=owners,
        tier_kind=None if tier is None else tier.kind,
        tier_capacity_bytes=0 if tier is None else tier.capacity_bytes,
    )


def _with_tier(stats: OwnerStats, tier: TierOwnerStats | None, budget: TierBudget) -> OwnerStats:
    """An owner's stats with its part of the second tier."""
    stats = dataclasses.replace(
        stats, tier_quota_bytes=budget.quota_bytes, tier_reserved_bytes=budget.reserved_bytes
    )
    if tier is None:
        return stats
    counters = tier.counters
    return dataclasses.replace(
        stats,
        tier_bytes=tier.held_bytes,
        tier_entries=tier.entries,
        tier_offloads=counters.offloads,
        tier_loads=counters.loads,
        tier_loaded_bytes=counters.loaded_bytes,
        tier_misses=counters.missed,
        tier_drops=counters.dropped,
        tier_evicted=counters.evicted_own + counters.evicted_pressure,
        tier_purged=counters.purged,
    )
