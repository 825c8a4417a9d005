"""The KV cache manager: decides which blocks a request gets, reuses, commits and gives back.

The block pool owns memory, the prefix cache maps keys to blocks, the hasher makes keys, the
quotas say who may hold how many blocks and who loses cached blocks when room is short
(`quotas.py`); this module decides, over a request's life:
- `match`: the longest verified chain of cached blocks its tokens can reuse;
- `admit` / `fork` / `allocate`: blocks for it, all or nothing (a refusal changes nothing);
- `commit`: its full, computed blocks into the prefix cache, under their scopes;
- `free`: its blocks back, cached ones turning idle;
and, for admins, `purge` and `drop_public`, which take blocks out of the cache at once.
"""

from __future__ import annotations

from collections import Counter, abc

from engine.cache.block_hash import BlockHash, BlockHasher, block_token_bytes
from engine.cache.block_pool import Block, BlockPool
from engine.cache.budget import PUBLIC_OWNER, Owner, Refusal, TenantBudget, owner_of
from engine.cache.cache_request import (
    CacheRequest,
    CacheSequence,
    KeyChain,
    PrefixMatch,
    source_kind,
)
from engine.cache.eviction import BlockCost, EvictionPolicy, position_cost
from engine.cache.prefix_cache import PrefixCache
from engine.cache.quotas import EvictionPlan, OwnerCounters, Quotas
from engine.cache.scope import Public, Segment
from engine.cache.tier.store import TierBudget
from engine.cache.tier_link import TierLink
from engine.math_utils import cdiv


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
        eviction: EvictionPolicy = "value",
        block_cost: BlockCost = position_cost,
    ) -> None:
        """`eviction` picks which idle block goes first (`engine/cache/eviction.py`);
        `block_cost` is what recomputing the block at each position costs, in ms."""
        if hasher.block_size != pool.spec.block_size:
            raise ValueError("hasher and pool disagree on block_size")
        self.pool = pool
        self.hasher = hasher
        self.root = root
        self.block_size = pool.spec.block_size
        self.prefix_cache = PrefixCache()
        self.enable_prefix_caching = enable_prefix_caching
        self.quotas = Quotas(
            pool,
            self.prefix_cache,
            default_budget or TenantBudget(pool.num_blocks),
            eviction,
            block_cost,
        )
        self._sequences: dict[str, CacheSequence] = {}
        self.peak_active_blocks = 0
        # The second tier, when the engine has one (`attach_tier`).
        self.tier: TierLink | None = None
        self.set_budget(PUBLIC_OWNER, public_budget or TenantBudget(pool.num_blocks))

    def attach_tier(self, link: TierLink) -> None:
        """Offload committed blocks to a second tier and read blocks back from it."""
        self.tier = link
        for owner in self.quotas.owners():
            link.apply_budget(owner, self.tier_budget(owner))

    # -- budgets ------------------------------------------------------------------------------

    def budget(self, owner: Owner) -> TenantBudget:
        """The owner's quota and reservation (the default budget if it has none of its own)."""
        return self.quotas.budget(owner)

    def owners(self) -> set[Owner]:
        """Every owner that holds blocks, has been counted or has a budget of its own."""
        return self.quotas.owners()

    def counters(self, owner: Owner) -> OwnerCounters:
        """A copy of the owner's running totals."""
        return self.quotas.counters(owner)

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Set an owner's quota and reservation now; returns how many idle blocks it evicted
        (see `Quotas.set_budget`)."""
        evicted = self.quotas.set_budget(owner, budget)
        if self.tier is not None:
            self.tier.apply_budget(owner, self.tier_budget(owner))
        return evicted

    # -- request lifecycle --------------------------------------------------------------------

    def match(
        self, request: CacheRequest, chain: KeyChain | None = None, *, reuse: bool = True
    ) -> PrefixMatch:
        """The longest verified chain of cached blocks for the request's tokens so far.

        `chain` holds those tokens and the keys computed for them at earlier attempts (None:
        a chain of the prompt is made); keys are computed only past those. Without `reuse`
        no cached block is hit (every position is computed; its blocks are still cached for
        others). The last token is never served from cache: its logits are needed.
        """
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        if chain is None:
            chain = KeyChain.of(request, self.block_size)
        sequence = CacheSequence(request, chain)
        blocks: list[Block] = []
        tier_blocks = 0
        if self.enable_prefix_caching and reuse:
            limit = (chain.num_tokens - 1) // self.block_size
            self._extend_keys(chain, limit)
            parent: Block | None = None
            parent_key = self.root
            for index, key in enumerate(chain.keys[:limit]):
                block = self.prefix_cache.lookup(
                    key, parent_key, parent, chain.scopes[index], self._block_bytes(chain, index)
                )
                if block is None:
                    break
                blocks.append(block)
                parent, parent_key = block, key
            if self.tier is not None:
                tier_blocks = self.tier.stage(request, chain, len(blocks), limit)
        generations = [block.generation for block in blocks]
        return PrefixMatch(blocks, self.block_size, sequence, generations, tier_blocks)

    def admit(self, hit: PrefixMatch, num_new_tokens: int) -> Refusal | None:
        """Start a request: reference its cached prefix and allocate for `num_new_tokens` more.

        Atomic: a refusal leaves the pool and the cache untouched. The request's key chain may
        have gained keys and block scopes, which hold for the request's whole life.
        """
        sequence = hit._record
        request = sequence.request
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        if [block.generation for block in hit.blocks] != hit._generations:
            raise ValueError("stale prefix match: the cache changed since match()")
        if request.budget is not None:
            self.quotas.apply_requested(request.tenant_id, request.budget)
        if self.tier is not None and request.seal_keys is not None:
            self.tier.apply_budget(request.tenant_id, self.tier_budget(request.tenant_id))
        pinned = Counter(b.owner for b in hit.blocks if b.ref_count == 0 and b.owner is not None)
        total_tokens = hit.cached_tokens + num_new_tokens
        refusal = self._allocate(sequence, total_tokens, pinned, hit.blocks)
        if refusal is not None:
            return refusal
        self._sequences[request.request_id] = sequence
        sequence.cached_tokens = hit.cached_tokens
        sequence.committed_blocks = len(hit.blocks)
        sequence.commit_parent = hit.blocks[-1] if hit.blocks else None
        self._write_staged(sequence, len(hit.blocks), hit.tier_blocks)
        counters = self.quotas.tally(request.tenant_id)
        counters.prompt_tokens += sequence.chain.num_tokens
        counters.cached_tokens += hit.cached_tokens
        counters.tier_tokens += hit.tier_blocks * self.block_size
        self._tally_public(sequence, hit.blocks)
        return None

    def _tally_public(self, sequence: CacheSequence, hits: list[Block]) -> None:
        """The public budget's reuse: the prompt's tokens in whole public blocks, and those
        read from cached public blocks (a tenant's counters hold all of its prompt)."""
        full = sequence.chain.num_tokens // self.block_size
        public = sum(1 for scope in sequence.chain.scopes[:full] if isinstance(scope, Public))
        if public:
            counters = self.quotas.tally(PUBLIC_OWNER)
            counters.prompt_tokens += public * self.block_size
            read = sum(1 for block in hits if block.owner is PUBLIC_OWNER)
            counters.cached_tokens += read * self.block_size

    def fork(self, parent_id: str, child: CacheRequest, chain: KeyChain) -> Refusal | None:
        """Admit `child`, whose tokens (`chain`) are exactly the parent's computed ones, on
        the parent's KV.

        The parent's full blocks gain a reference each (nothing is recomputed or copied); a
        partly filled last block is copied into a block of the child's own, since both will
        write their next tokens into it. The child's chain takes the parent's keys (the same
        tokens under the same scopes). The prompt is counted once, on the parent. Atomic, as
        `admit` is.
        """
        if child.request_id in self._sequences:
            raise ValueError(f"request {child.request_id!r} is already admitted")
        parent = self._sequences[parent_id]
        if chain.token_bytes != parent.chain.token_bytes:
            raise ValueError("a fork must hold exactly its parent's tokens")
        chain.scopes, chain.keys = list(parent.chain.scopes), list(parent.chain.keys)
        num_tokens = chain.num_tokens
        shared = parent.blocks[: num_tokens // self.block_size]
        record = CacheSequence(child, chain)
        refusal = self._allocate(record, num_tokens, Counter(), shared)
        if refusal is not None:
            return refusal
        if len(record.blocks) > len(shared):
            self.pool.copy_block(parent.blocks[len(shared)], record.blocks[len(shared)])
        # Only blocks past the shared ones are the child's own computation (see `free`).
        record.cached_tokens = len(shared) * self.block_size
        record.committed_blocks = parent.committed_blocks
        record.commit_parent = parent.commit_parent
        record.commit_stopped = parent.commit_stopped
        self._sequences[child.request_id] = record
        return None

    def allocate(self, request_id: str, total_tokens: int) -> Refusal | None:
        """Make sure an admitted request has blocks for its first `total_tokens` tokens."""
        return self._allocate(self._sequences[request_id], total_tokens, Counter(), [])

    def append_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Record generated tokens (in the request's chain) so their full blocks can be keyed
        and committed."""
        self._sequences[request_id].chain.append(token_ids)

    def commit(self, request_id: str, num_computed_tokens: int) -> int:
        """Cache the request's full, computed blocks under their scopes; returns how many.

        Stops for good at the first `NoCache` block and at the first key collision, so a
        cached block's parent is always a cached block with exactly its real predecessor's
        contents.
        """
        sequence = self._sequences[request_id]
        if not self.enable_prefix_caching or sequence.commit_stopped:
            return 0
        chain = sequence.chain
        full_blocks = min(num_computed_tokens // self.block_size, len(sequence.blocks))
        self._extend_keys(chain, full_blocks)
        committed = 0
        fresh: list[tuple[int, Block]] = []  # committed here, not read back from the tier
        while sequence.committed_blocks < full_blocks:
            index = sequence.committed_blocks
            if index >= len(chain.keys):  # a NoCache block: nothing from here on is cached
                sequence.commit_stopped = True
                break
            block = sequence.blocks[index]
            cached = self.prefix_cache.insert(
                block,
                chain.keys[index],
                chain.keys[index - 1] if index else self.root,
                sequence.commit_parent,
                chain.scopes[index],
                self._block_bytes(chain, index),
            )
            if cached is None:
                sequence.commit_stopped = True
                break
            if cached is block:
                committed += 1
                if index not in chain.from_tier:
                    fresh.append((index, block))
            sequence.commit_parent = cached
            sequence.committed_blocks += 1
        if self.tier is not None:
            self.tier.offload(fresh, sequence.request, chain.num_tokens // self.block_size)
        return committed

    def blocks_charged(
        self, request: CacheRequest, chain: KeyChain, num_tokens: int
    ) -> Counter[Owner]:
        """How many blocks each owner pays for while the request (tokens and scopes: `chain`)
        holds `num_tokens` tokens.

        Reads only the request, its chain (whose scopes it extends) and fixed settings, so any
        thread may ask about a request not yet submitted.
        """
        num_blocks = cdiv(num_tokens, self.block_size)
        chain.extend_scopes(num_blocks)
        tenant_id = request.tenant_id
        return Counter(owner_of(scope, tenant_id) for scope in chain.scopes[:num_blocks])

    def free(self, request_id: str, keep_computed: bool = True) -> None:
        """Give back a finished or cancelled request's blocks, tail first.

        Cached blocks turn idle (the chain's tail least recently used), uncached ones go to
        be zeroed, and an owner over its quota sheds idle blocks at once. Without
        `keep_computed` (the request failed: its KV may be what failed it) the blocks it
        computed itself leave the cache first, so nobody can hit them any more. The request's
        key chain stays with the request, for its next admission.
        """
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        if not keep_computed:
            computed = sequence.blocks[sequence.cached_tokens // self.block_size :]
            if self.tier is not None:  # its tier copies, queued or stored, go too
                self.tier.drop([block.key for block in computed if block.key is not None])
            for block in computed:
                self.quotas.unhook(block)
        for block in reversed(sequence.blocks):
            self.pool.unref(block)
        for owner in {block.owner for block in sequence.blocks}:
            if owner is not None:
                self.quotas.evict_over_quota(owner)

    def end_step(self) -> int:
        """Zero, in one batched operation, every block that left a scope during this step."""
        return self.pool.flush_zeroing()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [block.block_id for block in self._sequences[request_id].blocks]

    def num_blocks(self, request_id: str) -> int:
        return len(self._sequences[request_id].blocks)

    # -- admin actions ------------------------------------------------------------------------

    def purge(self, tenant_id: str) -> int:
        """Drop every block the tenant owns from the cache and zero the idle ones now.

        Blocks still in use by the tenant's running requests lose their keys (nobody can hit
        them any more) and are zeroed when those requests end; cancel them first for an
        immediate wipe.
        """
        owned = [b for b in self.pool.blocks if b.owner == tenant_id and b.key is not None]
        return self.quotas.drop(tenant_id, owned)

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
        chain = KeyChain.of(prefix, self.block_size)
        self._extend_keys(chain, full_blocks)
        keys = set(chain.keys)
        if self.tier is not None:
            self.tier.drop(chain.keys)
        # A block carries its key exactly while the prefix cache maps that key to it.
        return self.quotas.drop(PUBLIC_OWNER, [b for b in self.pool.blocks if b.key in keys])

    # -- internals ----------------------------------------------------------------------------

    def _extend_keys(self, chain: KeyChain, num_blocks: int) -> None:
        """Key the chain's first `num_blocks` blocks, hashing only those not keyed before."""
        chain.extend_scopes(num_blocks)
        have = len(chain.keys)
        if have < num_blocks:
            parent = chain.keys[-1] if have else self.root
            chain.keys += self.hasher.chain(
                parent, chain.token_bytes, chain.scopes, have, num_blocks
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
        chain = sequence.chain
        chain.extend_scopes(needed_blocks)
        tenant_id = sequence.request.tenant_id
        owners = [owner_of(scope, tenant_id) for scope in chain.scopes[have:needed_blocks]]
        plan = self.quotas.plan(owners, pinned)
        if not isinstance(plan, EvictionPlan):
            return plan
        # Carry it out: nothing below can fail.
        for block in hits:
            self.pool.ref(block)
        sequence.blocks += hits
        self._evict_for(plan, sequence.request)
        for owner in owners:
            sequence.blocks += self.pool.take(owner, 1)
        self.peak_active_blocks = max(self.peak_active_blocks, self.pool.num_active)
        return None

    def _evict_for(self, plan: EvictionPlan, request: CacheRequest) -> None:
        """Carry out `plan`'s evictions, counted in the request's ledger per owner."""
        victims = set(plan.own) | set(plan.allowance)
        before = {owner: self.quotas.counters(owner).evicted_blocks for owner in victims}
        self.quotas.evict_for(plan)
        for owner in victims:
            evicted = self.quotas.counters(owner).evicted_blocks - before[owner]
            if evicted:
                request.ledger.evicted[owner] += evicted

    def _write_staged(self, sequence: CacheSequence, first: int, count: int) -> None:
        """Write the tier's staged KV of blocks `first`.. into the request's own blocks, cache
        them, and record where the request's cached blocks came from."""
        chain = sequence.chain
        chain.from_tier = set(range(first, first + count))
        for index in range(first, first + count):
            kv = chain.staged.pop(index)
            self.pool.kv[:, :, sequence.blocks[index].block_id].copy_(kv)
        chain.staged.clear()
        ledger = sequence.request.ledger
        ledger.sources.clear()
        for index in range(first + count):
            tier = "tier" if index in chain.from_tier else "pool"
            ledger.sources[source_kind(chain.scopes[index]), tier] += 1
        if count:
            ledger.tier_loads += count
            ledger.tier_bytes += count * self.pool.spec.bytes_per_block
            self.commit(sequence.request.request_id, (first + count) * self.block_size)

    def tier_budget(self, owner: Owner) -> TierBudget:
        """The owner's budget in the second tier: its own, else room for as many blocks as its
        pool quota (each at what the tier charges for one)."""
        budget = self.quotas.budget(owner)
        quota = budget.tier_quota_bytes
        if quota is None:
            per_block = self.pool.spec.bytes_per_block
            if self.tier is not None:
                per_block = self.tier.tier.bytes_per_entry
            quota = max(budget.quota_blocks * per_block, budget.tier_reserved_bytes)
        return TierBudget(quota, budget.tier_reserved_bytes)

    def _block_bytes(self, chain: KeyChain, index: int) -> bytes:
        """The encoded token ids of block `index`: what a cached block's contents are
        verified against."""
        return block_token_bytes(chain.token_bytes, index, self.block_size)
