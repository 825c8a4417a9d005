"""Snapshots of the KV cache: per-owner blocks and reuse, pool-wide counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.quotas import OwnerCounters


@dataclass(frozen=True, slots=True)
class OwnerStats:
    """One owner's blocks (in use, and idle but cached), its budget and its running totals."""

    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    counters: OwnerCounters = field(default_factory=OwnerCounters)


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
    owners = {}
    for owner in cache.owners():
        budget = cache.budget(owner)
        owned, idle = pool.owned(owner), pool.idle_count(owner)
        owners[owner] = OwnerStats(
            active_blocks=owned - idle,
            cached_blocks=idle,
            reserved_blocks=budget.reserved_blocks,
            quota_blocks=budget.quota_blocks,
            counters=cache.counters(owner),
        )
    return CacheStats(
        num_blocks=pool.num_blocks,
        free_blocks=pool.num_available,
        cached_keys=len(cache.prefix_cache),
        blocks_zeroed=pool.blocks_zeroed,
        zero_operations=pool.zero_operations,
        collisions=cache.prefix_cache.collisions,
        peak_active_blocks=cache.peak_active_blocks,
        owners=owners,
    )
