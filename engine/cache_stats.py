"""Snapshots of the KV cache: per-owner blocks and reuse, pool-wide counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.budget import Owner


@dataclass(slots=True)
class OwnerCounters:
    """Running totals for one owner (a tenant or the public budget)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_blocks: int = 0
    purged_blocks: int = 0

    @property
    def reuse(self) -> float:
        """Token-weighted reuse: prompt tokens served from cache over prompt tokens queried."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class OwnerStats:
    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    counters: OwnerCounters = field(default_factory=OwnerCounters)


@dataclass(frozen=True, slots=True)
class CacheStats:
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
        return sum(owner.counters.evicted_blocks for owner in self.owners.values())
