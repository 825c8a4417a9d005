"""Owners' quotas: each owner's budget, the evictions that keep allocations within the
budgets and the pool, and each owner's running totals.

An allocation is planned before anything changes (`Quotas.plan`):
- an owner that would go over its quota evicts its own idle blocks first;
- a full pool evicts idle blocks of owners above their reservation (or of the requesting owners
  themselves), never a block another owner has reserved;
- what cannot be satisfied is refused and changes nothing: `QuotaExceeded` (over its own
  quota), `ShareExceeded` (the pool is short and the owner would hold more than the pool less
  what other owners hold within their reservations: its own limit, though no quota says so)
  or `PoolExhausted` (the pool is short for an owner within that share: a crowded pool).

The plan says who loses blocks and how many; which blocks is the eviction policy's choice
(`engine/cache/eviction.py`, carried out by the pool's `victim`): "value" evicts an owner's
idle block worth the least per byte (and under pressure, the least worth among the owners the
plan allows), "lru" the least recently used.

Every eviction is counted on its victim as *own* (the owner made room for itself: over its
quota, or the pool short for its own allocation) or *pressure* (the pool was short for another
owner's allocation), so an admin can tell a tight quota from a crowded neighbour. Blocks an admin
removes (a tenant purge, a dropped public prefix) count as purged, not evicted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from engine.cache.block_pool import Block, BlockPool, Rank
from engine.cache.budget import (
    PUBLIC_OWNER,
    Owner,
    PoolExhausted,
    QuotaExceeded,
    Refusal,
    ShareExceeded,
    TenantBudget,
)
from engine.cache.eviction import BlockCost, EvictionPolicy, position_cost
from engine.cache.prefix_cache import PrefixCache

# Why an idle block was evicted, i.e. which of its owner's counters it lands on.
EvictionCause = Literal["own", "pressure"]


@dataclass(slots=True)
class OwnerCounters:
    """Running totals for one owner (a tenant or the public budget).

    A tenant's prompt and cached tokens are all of its requests' (public blocks they read
    included); the public budget's are the prompt tokens in public blocks, of any tenant's
    request, and those read from its cached blocks.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_own_blocks: int = 0
    evicted_pressure_blocks: int = 0
    purged_blocks: int = 0
    # Of the cached tokens, those read back from the second tier (the rest: from the pool).
    tier_tokens: int = 0

    @property
    def evicted_blocks(self) -> int:
        """Every eviction of the owner's blocks, own and pressure."""
        return self.evicted_own_blocks + self.evicted_pressure_blocks

    @property
    def reuse(self) -> float:
        """Token-weighted reuse: prompt tokens served from cache over prompt tokens queried."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class EvictionPlan:
    """The evictions that make room for an allocation; carrying them out cannot fail."""

    # New blocks each owner pays for.
    needs: Counter[Owner]
    # Each owner's evictions of its own blocks to stay within its quota.
    own: Counter[Owner]
    # Blocks the pool still lacks after those, each taken from the owner whose next victim
    # ranks lowest (the policy's order)...
    shortfall: int
    # ...each of which may lose up to this many idle blocks.
    allowance: dict[Owner, int]


class Quotas:
    """Each owner's budget and counters, and the evictions made in their name."""

    def __init__(
        self,
        pool: BlockPool,
        prefix_cache: PrefixCache,
        default_budget: TenantBudget,
        eviction: EvictionPolicy = "value",
        block_cost: BlockCost = position_cost,
    ) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.set_eviction(eviction, block_cost)
        self.default_budget = default_budget
        self._budgets: dict[Owner, TenantBudget] = {}
        # Budgets as requests carried them, before any reservation was clamped to fit the pool.
        self._requested: dict[Owner, TenantBudget] = {}
        self._counters: dict[Owner, OwnerCounters] = {}

    # -- budgets and counters -----------------------------------------------------------------

    def budget(self, owner: Owner) -> TenantBudget:
        """The owner's quota and reservation (the default budget if it has none of its own)."""
        return self._budgets.get(owner, self.default_budget)

    def owners(self) -> set[Owner]:
        """Every owner that holds blocks, has been counted or has a budget of its own."""
        return set(self.pool.owners()) | set(self._counters) | set(self._budgets)

    def counters(self, owner: Owner) -> OwnerCounters:
        """A copy of the owner's running totals."""
        return dataclasses.replace(self._counters.get(owner, OwnerCounters()))

    def tally(self, owner: Owner) -> OwnerCounters:
        """The owner's running totals, to add to (made at first use)."""
        counters = self._counters.get(owner)
        if counters is None:
            counters = self._counters[owner] = OwnerCounters()
        return counters

    def set_eviction(self, eviction: EvictionPolicy, block_cost: BlockCost = position_cost) -> None:
        """Choose which idle blocks go first from now on (see the module docstring); the
        idle blocks are reordered at once. `block_cost`: ms to recompute a block at a position."""
        self.eviction = eviction
        self.block_cost = block_cost
        self.pool.set_eviction(eviction, block_cost)

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Set an owner's quota and reservation now; returns how many idle blocks it evicted.

        Shrinking below what the owner holds evicts idle blocks at once (the policy's
        victims); blocks in use stay until their requests end and are not kept cached after that
        while the owner is over quota.
        """
        others = sum(b.reserved_blocks for o, b in self._budgets.items() if o != owner)
        if others + budget.reserved_blocks > self.pool.num_blocks:
            raise ValueError(
                f"reservations would total {others + budget.reserved_blocks} blocks, "
                f"more than the pool's {self.pool.num_blocks}"
            )
        self._budgets[owner] = budget
        evicted = self.evict_over_quota(owner)
        self.pool.flush_zeroing()
        return evicted

    def apply_requested(self, owner: Owner, budget: TenantBudget) -> None:
        """Apply a budget that came with a request, unless it is the one applied last: its
        reservation is cut to what the pool has left rather than failing the request
        (reservations of all owners cannot exceed it)."""
        if budget == self._requested.get(owner):
            return
        others = sum(b.reserved_blocks for o, b in self._budgets.items() if o != owner)
        reserved = max(0, min(budget.reserved_blocks, self.pool.num_blocks - others))
        self.set_budget(owner, dataclasses.replace(budget, reserved_blocks=reserved))
        self._requested[owner] = budget

    # -- making room --------------------------------------------------------------------------

    def plan(self, owners: list[Owner], pinned: Counter[Owner]) -> EvictionPlan | Refusal:
        """The evictions that make room for one new block per entry of `owners` (who pays
        for it), or why there is none; `pinned` idle blocks (about to be reused) stay."""
        needs = Counter(owners)
        # First each owner's own evictions to stay within its quota...
        own: Counter[Owner] = Counter()
        for owner, need in needs.items():
            quota = self.budget(owner).quota_blocks
            evictable = self.pool.idle_count(owner) - pinned[owner]
            over = self.pool.owned(owner) + need - quota
            if over > evictable:
                active = self.pool.owned(owner) - self.pool.idle_count(owner) + pinned[owner]
                return QuotaExceeded(owner, need, quota, active)
            own[owner] = max(0, over)
        # ...then evictions among owners above their reservations if the pool itself is short.
        available = self.pool.num_available + own.total()
        shortfall = len(owners) - available
        allowance: dict[Owner, int] = {}
        if shortfall > 0:
            for owner in self.pool.idle_owners():
                idle = self.pool.idle_count(owner) - pinned[owner] - own[owner]
                if owner not in needs:  # others' pressure stops at the owner's reservation
                    above = self.pool.owned(owner) - self.budget(owner).reserved_blocks
                    idle = min(idle, above)
                if idle > 0:
                    allowance[owner] = idle
            if sum(allowance.values()) < shortfall:
                return self._past_share(needs, pinned) or PoolExhausted(
                    len(owners), available + sum(allowance.values())
                )
        return EvictionPlan(needs, own, shortfall, allowance)

    def _past_share(self, needs: Counter[Owner], pinned: Counter[Owner]) -> ShareExceeded | None:
        """Which owner of a refused allocation is past its share of the full pool, if any
        (a tenant before the public budget): its blocks in use plus those it needs exceed
        the pool less what the other owners hold within their reservations.

        Such an owner waits on its own limit, which no neighbour's request ending will lift
        while the neighbours keep their reservations; one within its share waits on a crowded
        pool.
        """
        held_reserved = {
            owner: min(self.pool.owned(owner), self.budget(owner).reserved_blocks)
            for owner in self.pool.owners()
        }
        total_reserved = sum(held_reserved.values())
        for owner in sorted(needs, key=lambda owner: owner is PUBLIC_OWNER):
            share = self.pool.num_blocks - (total_reserved - held_reserved.get(owner, 0))
            active = self.pool.owned(owner) - self.pool.idle_count(owner) + pinned[owner]
            if active + needs[owner] > share:
                return ShareExceeded(owner, needs[owner], share, active)
        return None

    def evict_for(self, plan: EvictionPlan) -> None:
        """Carry out `plan`'s evictions."""
        for owner, count in plan.own.items():
            for _ in range(count):
                self._evict_next(owner, "own")
        allowance = dict(plan.allowance)
        for _ in range(max(0, plan.shortfall)):
            owner = min((o for o, left in allowance.items() if left), key=self._victim_rank)
            allowance[owner] -= 1
            # Making room for one's own blocks is not a neighbour's pressure.
            self._evict_next(owner, "own" if owner in plan.needs else "pressure")

    def evict_over_quota(self, owner: Owner) -> int:
        """Evict the owner's idle blocks (the policy's victims) while it holds more than its
        quota; returns how many."""
        evicted = 0
        while self.pool.owned(owner) > self.budget(owner).quota_blocks:
            if self.pool.victim(owner) is None:
                break
            self._evict_next(owner, "own")
            evicted += 1
        return evicted

    # -- taking blocks out of the cache -------------------------------------------------------

    def drop(self, owner: Owner, blocks: list[Block]) -> int:
        """Take cached blocks out of the cache for an admin: idle ones are zeroed now, those in
        use lose their keys and are zeroed once released. Counted as purged on `owner`."""
        for block in blocks:
            if block.ref_count:
                self.unhook(block)
            else:
                self._evict(block, None)
        self.pool.flush_zeroing()
        self.tally(owner).purged_blocks += len(blocks)
        return len(blocks)

    def unhook(self, block: Block) -> None:
        """Uncache a block still in use: nobody can hit it any more; it is zeroed once released."""
        self.prefix_cache.remove(block)
        self.pool.clear_identity(block)

    def _victim_rank(self, owner: Owner) -> Rank:
        block = self.pool.victim(owner)
        assert block is not None
        return self.pool.rank(block)

    def _evict_next(self, owner: Owner, cause: EvictionCause) -> None:
        block = self.pool.victim(owner)
        assert block is not None
        self._evict(block, cause)

    def _evict(self, block: Block, cause: EvictionCause | None) -> None:
        """Evict an idle cached block, counted under `cause` (None: `drop` counts it)."""
        assert block.owner is not None
        if cause == "own":
            self.tally(block.owner).evicted_own_blocks += 1
        elif cause == "pressure":
            self.tally(block.owner).evicted_pressure_blocks += 1
        self.prefix_cache.remove(block)
        self.pool.evict(block, by_policy=cause is not None)
