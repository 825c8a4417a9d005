"""The KV cache manager: decides which blocks a request gets, reuses, commits and gives back.

The block pool owns memory, the prefix cache maps keys to blocks, the hasher makes keys; this
module decides. It enforces per-owner quotas and reservations:
- an owner that would go over its quota evicts its own least recently used idle blocks first;
- a full pool evicts the global LRU idle block among owners above their reservation (or the
  requesting owners themselves), never a block another owner has reserved;
- what cannot be satisfied is refused with `QuotaExceeded` or `PoolExhausted` and changes
  nothing.
Every eviction is counted on its victim as *own* (the owner made room for itself: over its
quota, or the pool short for its own allocation) or *pressure* (the pool was short for another
owner's allocation), so an admin can tell a tight quota from a crowded neighbour. Blocks an admin
removes (a tenant purge, a dropped public prefix) count as purged, not evicted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, abc
from dataclasses import dataclass
from typing import Literal

from engine.cache.block_hash import BlockHash, BlockHasher, block_token_bytes, encode_token_ids
from engine.cache.block_pool import Block, BlockPool
from engine.cache.budget import (
    PUBLIC_OWNER,
    Owner,
    PoolExhausted,
    QuotaExceeded,
    Refusal,
    TenantBudget,
    owner_of,
)
from engine.cache.cache_request import (
    CacheRequest,
    CacheSequence,
    PrefixMatch,
    request_block_scopes,
)
from engine.cache.prefix_cache import PrefixCache
from engine.cache.scope import Public, Segment, no_less_private
from engine.math_utils import cdiv

# Why an idle block was evicted, i.e. which of its owner's counters it lands on.
EvictionCause = Literal["own", "pressure"]


@dataclass(slots=True)
class OwnerCounters:
    """Running totals for one owner (a tenant or the public budget)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_own_blocks: int = 0
    evicted_pressure_blocks: int = 0
    purged_blocks: int = 0

    @property
    def evicted_blocks(self) -> int:
        """Every eviction of the owner's blocks, own and pressure."""
        return self.evicted_own_blocks + self.evicted_pressure_blocks

    @property
    def reuse(self) -> float:
        """Token-weighted reuse: prompt tokens served from cache over prompt tokens queried."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class KVCacheManager:
    """Allocates, matches, commits and frees KV blocks for requests, under tenant budgets."""

    def __init__(
        self,
        pool: BlockPool,
        hasher: BlockHasher,
        root: BlockHash,
        public_budget: TenantBudget | None = None,
        default_budget: TenantBudget | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        if hasher.block_size != pool.spec.block_size:
            raise ValueError("hasher and pool disagree on block_size")
        self.pool = pool
        self.hasher = hasher
        self.root = root
        self.block_size = pool.spec.block_size
        self.prefix_cache = PrefixCache()
        self.enable_prefix_caching = enable_prefix_caching
        self.default_budget = default_budget or TenantBudget(pool.num_blocks)
        self._budgets: dict[Owner, TenantBudget] = {}
        # Budgets as requests carried them, before any reservation was clamped to fit the pool.
        self._requested: dict[Owner, TenantBudget] = {}
        self._counters: dict[Owner, OwnerCounters] = {}
        self._sequences: dict[str, CacheSequence] = {}
        self.peak_active_blocks = 0
        self.set_budget(PUBLIC_OWNER, public_budget or TenantBudget(pool.num_blocks))

    # -- budgets ------------------------------------------------------------------------------

    def budget(self, owner: Owner) -> TenantBudget:
        """The owner's quota and reservation (the default budget if it has none of its own)."""
        return self._budgets.get(owner, self.default_budget)

    def owners(self) -> set[Owner]:
        """Every owner that holds blocks, has been counted or has a budget of its own."""
        return set(self.pool.owners()) | set(self._counters) | set(self._budgets)

    def counters(self, owner: Owner) -> OwnerCounters:
        """A copy of the owner's running totals."""
        return dataclasses.replace(self._counters.get(owner, OwnerCounters()))

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Set an owner's quota and reservation now; returns how many idle blocks it evicted.

        Shrinking below what the owner holds evicts its least recently used idle blocks at
        once; blocks in use stay until their requests end and are not kept cached after that
        while the owner is over quota.
        """
        others = sum(b.reserved_blocks for o, b in self._budgets.items() if o != owner)
        if others + budget.reserved_blocks > self.pool.num_blocks:
            raise ValueError(
                f"reservations would total {others + budget.reserved_blocks} blocks, "
                f"more than the pool's {self.pool.num_blocks}"
            )
        self._budgets[owner] = budget
        evicted = self._evict_over_quota(owner)
        self.pool.flush_zeroing()
        return evicted

    def _apply_requested_budget(self, owner: Owner, budget: TenantBudget) -> None:
        """A budget that came with a request: its reservation is cut to what the pool has
        left rather than failing the request (reservations of all owners cannot exceed it)."""
        others = sum(b.reserved_blocks for o, b in self._budgets.items() if o != owner)
        reserved = max(0, min(budget.reserved_blocks, self.pool.num_blocks - others))
        self.set_budget(owner, TenantBudget(budget.quota_blocks, reserved))
        self._requested[owner] = budget

    # -- request lifecycle --------------------------------------------------------------------

    def match(self, request: CacheRequest) -> PrefixMatch:
        """The longest verified chain of cached blocks for the request's prompt.

        The last prompt token is never served from cache: its logits are needed.
        """
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        sequence = self._new_sequence(request)
        blocks: list[Block] = []
        if self.enable_prefix_caching and request.reuse:
            limit = (len(request.prompt_token_ids) - 1) // self.block_size
            self._extend_keys(sequence, limit)
            parent: Block | None = None
            parent_key = self.root
            for index, key in enumerate(sequence.keys[:limit]):
                block = self.prefix_cache.lookup(
                    key, parent_key, parent, sequence.scopes[index], self._chunk(sequence, index)
                )
                if block is None:
                    break
                blocks.append(block)
                parent, parent_key = block, key
        generations = [block.generation for block in blocks]
        return PrefixMatch(blocks, self.block_size, sequence, generations)

    def admit(self, hit: PrefixMatch, num_new_tokens: int) -> Refusal | None:
        """Start a request: reference its cached prefix and allocate for `num_new_tokens` more.

        Atomic: a refusal leaves the pool, the cache and the request untouched.
        """
        sequence = hit._record
        request = sequence.request
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        if [block.generation for block in hit.blocks] != hit._generations:
            raise ValueError("stale prefix match: the cache changed since match()")
        if request.budget is not None and request.budget != self._requested.get(request.tenant_id):
            self._apply_requested_budget(request.tenant_id, request.budget)
        pinned = Counter(b.owner for b in hit.blocks if b.ref_count == 0 and b.owner is not None)
        total_tokens = hit.cached_tokens + num_new_tokens
        refusal = self._allocate(sequence, total_tokens, pinned, hit.blocks)
        if refusal is not None:
            return refusal
        self._sequences[request.request_id] = sequence
        sequence.cached_tokens = hit.cached_tokens
        sequence.committed_blocks = len(hit.blocks)
        sequence.chain_parent = hit.blocks[-1] if hit.blocks else None
        counters = self._counter(request.tenant_id)
        counters.prompt_tokens += len(request.prompt_token_ids)
        counters.cached_tokens += hit.cached_tokens
        return None

    def fork(self, parent_id: str, child: CacheRequest) -> Refusal | None:
        """Admit `child`, whose tokens are exactly the parent's computed ones, on the parent's KV.

        The parent's full blocks gain a reference each (nothing is recomputed or copied); a
        partly filled last block is copied into a block of the child's own, since both will
        write their next tokens into it. The prompt is counted once, on the parent. Atomic, as
        `admit` is.
        """
        if child.request_id in self._sequences:
            raise ValueError(f"request {child.request_id!r} is already admitted")
        parent = self._sequences[parent_id]
        num_tokens = len(child.prompt_token_ids)
        if bytes(encode_token_ids(child.prompt_token_ids)) != bytes(parent.token_bytes):
            raise ValueError("a fork must hold exactly its parent's tokens")
        shared = parent.blocks[: num_tokens // self.block_size]
        record = CacheSequence(
            child, bytearray(parent.token_bytes), list(parent.scopes), keys=list(parent.keys)
        )
        refusal = self._allocate(record, num_tokens, Counter(), shared)
        if refusal is not None:
            return refusal
        if len(record.blocks) > len(shared):
            self.pool.copy_block(parent.blocks[len(shared)], record.blocks[len(shared)])
        # Only blocks past the shared ones are the child's own computation (see `free`).
        record.cached_tokens = len(shared) * self.block_size
        record.committed_blocks = parent.committed_blocks
        record.chain_parent = parent.chain_parent
        record.commit_stopped = parent.commit_stopped
        self._sequences[child.request_id] = record
        return None

    def allocate(self, request_id: str, total_tokens: int) -> Refusal | None:
        """Make sure an admitted request has blocks for its first `total_tokens` tokens."""
        return self._allocate(self._sequences[request_id], total_tokens, Counter(), [])

    def append_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Record generated tokens so their full blocks can be keyed and committed."""
        self._sequences[request_id].token_bytes += encode_token_ids(token_ids)

    def commit(self, request_id: str, num_computed_tokens: int) -> int:
        """Cache the request's full, computed blocks under their scopes; returns how many.

        Stops for good at the first `NoCache` block and at the first key collision, so a
        cached block's parent is always a cached block with exactly its real predecessor's
        contents.
        """
        sequence = self._sequences[request_id]
        if not self.enable_prefix_caching or sequence.commit_stopped:
            return 0
        full_blocks = min(num_computed_tokens // self.block_size, len(sequence.blocks))
        self._extend_keys(sequence, full_blocks)
        committed = 0
        while sequence.committed_blocks < full_blocks:
            index = sequence.committed_blocks
            if index >= len(sequence.keys):  # a NoCache block: nothing from here on is cached
                sequence.commit_stopped = True
                break
            block = sequence.blocks[index]
            cached = self.prefix_cache.insert(
                block,
                sequence.keys[index],
                sequence.keys[index - 1] if index else self.root,
                sequence.chain_parent,
                sequence.scopes[index],
                self._chunk(sequence, index),
            )
            if cached is None:
                sequence.commit_stopped = True
                break
            committed += cached is block
            sequence.chain_parent = cached
            sequence.committed_blocks += 1
        return committed

    def blocks_charged(self, request: CacheRequest, num_tokens: int) -> Counter[Owner]:
        """How many blocks each owner pays for while the request holds `num_tokens` tokens.

        Reads only the request and fixed settings, so any thread may ask.
        """
        sequence = self._new_sequence(request)
        num_blocks = cdiv(num_tokens, self.block_size)
        self._extend_scopes(sequence, num_blocks)
        tenant_id = request.tenant_id
        return Counter(owner_of(scope, tenant_id) for scope in sequence.scopes[:num_blocks])

    def free(self, request_id: str, keep_computed: bool = True) -> None:
        """Give back a finished or cancelled request's blocks, tail first.

        Cached blocks turn idle (the chain's tail least recently used), uncached ones go to
        be zeroed, and an owner over its quota sheds idle blocks at once. Without
        `keep_computed` (the request failed: its KV may be what failed it) the blocks it
        computed itself leave the cache first, so nobody can hit them any more.
        """
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        if not keep_computed:
            for block in sequence.blocks[sequence.cached_tokens // self.block_size :]:
                self._unhook(block)
        for block in reversed(sequence.blocks):
            self.pool.unref(block)
        for owner in {block.owner for block in sequence.blocks}:
            if owner is not None:
                self._evict_over_quota(owner)

    def purge(self, tenant_id: str) -> int:
        """Drop every block the tenant owns from the cache and zero the idle ones now.

        Blocks still in use by the tenant's running requests lose their keys (nobody can hit
        them any more) and are zeroed when those requests end; cancel them first for an
        immediate wipe.
        """
        owned = [b for b in self.pool.blocks if b.owner == tenant_id and b.key is not None]
        return self._drop(tenant_id, owned)

    def drop_public(self, namespace: str, token_ids: abc.Sequence[int]) -> int:
        """Drop the cached full blocks of a public prefix in `namespace`, as `purge` does.

        The keys are the ones a request starting with these tokens, public in `namespace`,
        looks up. Returns how many blocks were dropped, counted as purged on the public budget.
        """
        full_blocks = len(token_ids) // self.block_size
        if not full_blocks:
            return 0
        scope = Public(namespace)
        prefix = CacheRequest("drop-public", "", token_ids, [Segment(0, len(token_ids), scope)])
        sequence = self._new_sequence(prefix)
        self._extend_keys(sequence, full_blocks)
        keys = set(sequence.keys)
        # A block carries its key exactly while the prefix cache maps that key to it.
        return self._drop(PUBLIC_OWNER, [b for b in self.pool.blocks if b.key in keys])

    def end_step(self) -> int:
        """Zero, in one batched operation, every block that left a scope during this step."""
        return self.pool.flush_zeroing()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [block.block_id for block in self._sequences[request_id].blocks]

    def num_blocks(self, request_id: str) -> int:
        return len(self._sequences[request_id].blocks)

    # -- internals ----------------------------------------------------------------------------

    def _new_sequence(self, request: CacheRequest) -> CacheSequence:
        scopes = request_block_scopes(request, self.block_size)
        token_bytes = bytearray(encode_token_ids(request.prompt_token_ids))
        return CacheSequence(request, token_bytes, scopes)

    def _extend_scopes(self, sequence: CacheSequence, num_blocks: int) -> None:
        """Scopes for blocks of generated text: the tail scope, never less private."""
        tail = sequence.request.tail_scope
        while len(sequence.scopes) < num_blocks:
            sequence.scopes.append(no_less_private(tail, sequence.scopes[-1]))

    def _extend_keys(self, sequence: CacheSequence, num_blocks: int) -> None:
        self._extend_scopes(sequence, num_blocks)
        have = len(sequence.keys)
        if have < num_blocks:
            parent = sequence.keys[-1] if have else self.root
            sequence.keys += self.hasher.chain(
                parent, sequence.token_bytes, sequence.scopes, have, num_blocks
            )

    def _allocate(
        self,
        sequence: CacheSequence,
        total_tokens: int,
        pinned: Counter[Owner],
        hits: list[Block],
    ) -> Refusal | None:
        """Reference `hits`, then add blocks up to `total_tokens`, evicting as planned."""
        have = len(sequence.blocks) + len(hits)
        needed_blocks = cdiv(total_tokens, self.block_size)
        self._extend_scopes(sequence, needed_blocks)
        tenant_id = sequence.request.tenant_id
        owners = [owner_of(scope, tenant_id) for scope in sequence.scopes[have:needed_blocks]]
        needs = Counter(owners)

        # Plan: first each owner's own evictions to stay within its quota...
        own_evictions: Counter[Owner] = Counter()
        for owner, need in needs.items():
            quota = self.budget(owner).quota_blocks
            evictable = self.pool.idle_count(owner) - pinned[owner]
            over = self.pool.owned(owner) + need - quota
            if over > evictable:
                active = self.pool.owned(owner) - self.pool.idle_count(owner) + pinned[owner]
                return QuotaExceeded(owner, need, quota, active)
            own_evictions[owner] = max(0, over)
        # ...then global LRU evictions if the pool itself is short.
        available = self.pool.num_available + own_evictions.total()
        shortfall = len(owners) - available
        allowance: dict[Owner, int] = {}
        if shortfall > 0:
            for owner in self.pool.idle_owners():
                idle = self.pool.idle_count(owner) - pinned[owner] - own_evictions[owner]
                if owner not in needs:  # others' pressure stops at the owner's reservation
                    above = self.pool.owned(owner) - self.budget(owner).reserved_blocks
                    idle = min(idle, above)
                if idle > 0:
                    allowance[owner] = idle
            if sum(allowance.values()) < shortfall:
                return PoolExhausted(len(owners), available + sum(allowance.values()))

        # Execute: nothing below can fail.
        for block in hits:
            self.pool.ref(block)
        sequence.blocks += hits
        for owner, count in own_evictions.items():
            for _ in range(count):
                self._evict_oldest(owner, "own")
        for _ in range(max(0, shortfall)):
            owner = min((o for o, left in allowance.items() if left), key=self._oldest_release)
            allowance[owner] -= 1
            # Making room for one's own blocks is not a neighbour's pressure.
            self._evict_oldest(owner, "own" if owner in needs else "pressure")
        for owner in owners:
            sequence.blocks += self.pool.take(owner, 1)
        self.peak_active_blocks = max(self.peak_active_blocks, self.pool.num_active)
        return None

    def _oldest_release(self, owner: Owner) -> int:
        block = self.pool.oldest_idle(owner)
        assert block is not None
        return block.last_released

    def _evict_oldest(self, owner: Owner, cause: EvictionCause) -> None:
        block = self.pool.oldest_idle(owner)
        assert block is not None
        self._evict(block, cause)

    def _evict_over_quota(self, owner: Owner) -> int:
        evicted = 0
        while self.pool.owned(owner) > self.budget(owner).quota_blocks:
            if self.pool.oldest_idle(owner) is None:
                break
            self._evict_oldest(owner, "own")
            evicted += 1
        return evicted

    def _drop(self, owner: Owner, blocks: list[Block]) -> int:
        """Take cached blocks out of the cache for an admin: idle ones are zeroed now, those in
        use lose their keys and are zeroed once released. Counted as purged on `owner`."""
        for block in blocks:
            if block.ref_count:
                self._unhook(block)
            else:
                self._evict(block, None)
        self.pool.flush_zeroing()
        self._counter(owner).purged_blocks += len(blocks)
        return len(blocks)

    def _unhook(self, block: Block) -> None:
        """Uncache a block still in use: nobody can hit it any more; it is zeroed once released."""
        self.prefix_cache.remove(block)
        self.pool.clear_identity(block)

    def _evict(self, block: Block, cause: EvictionCause | None) -> None:
        """Evict an idle cached block, counted under `cause` (None: `_drop` counts it)."""
        assert block.owner is not None
        if cause == "own":
            self._counter(block.owner).evicted_own_blocks += 1
        elif cause == "pressure":
            self._counter(block.owner).evicted_pressure_blocks += 1
        self.prefix_cache.remove(block)
        self.pool.evict(block)

    def _chunk(self, sequence: CacheSequence, index: int) -> bytes:
        """The encoded token ids of block `index`."""
        return block_token_bytes(sequence.token_bytes, index, self.block_size)

    def _counter(self, owner: Owner) -> OwnerCounters:
        counters = self._counters.get(owner)
        if counters is None:
            counters = self._counters[owner] = OwnerCounters()
        return counters
