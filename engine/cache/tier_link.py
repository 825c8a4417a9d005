"""The link between the block pool and the second tier: what goes down, what comes back.

Down: a block is offloaded once, when it is committed (its KV is final then), sealed with the
key of its scope's owner (`SealKeys`), which also keys its entry id; the tier stores it in the
background, so the step never waits for it, and a block that later leaves the pool (evicted, or
its worker restarted) lives on there. Up: when a request's chain of cached blocks ends in the
pool, the blocks that follow are looked for in the tier, and read back when that costs less
than computing them again: bytes over the tier's measured bandwidth plus its latency against
the prefill's measured time for those positions (`TierSpeed.cheaper_than`). What comes back is
staged on the request's key chain, verified (key, scope, parent, tokens, model: a value that
fails any of them is a miss) and written into the request's own blocks when it is admitted.
"""

from __future__ import annotations

import itertools

from engine.cache.block_hash import BlockHash, block_token_bytes
from engine.cache.block_pool import Block, BlockPool
from engine.cache.budget import Owner, owner_of
from engine.cache.cache_request import CacheRequest, KeyChain
from engine.cache.eviction import BlockCost, EvictionPolicy, value_per_byte
from engine.cache.tier.entry import TierBlock
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.speed import TierSpeed
from engine.cache.tier.store import TierBudget

# Most blocks one admission reads back from the tier: the read is synchronous on the engine
# thread, so a long prompt's run is bounded per step like a prefill chunk (the rest is read
# back when the request is admitted again after a preemption, or computed).
MAX_STAGED_BLOCKS = 128


class TierLink:
    """Offloads committed blocks to a `KVTier` and stages tier blocks for requests."""

    def __init__(
        self,
        tier: KVTier,
        pool: BlockPool,
        root: BlockHash,
        block_cost: BlockCost,
        eviction: EvictionPolicy = "value",
    ) -> None:
        """`eviction` "lru" gives every entry the same value, so the tier's aged priorities
        order entries by their last use alone."""
        self.tier = tier
        self.eviction = eviction
        self.pool = pool
        self.root = root
        self.block_cost = block_cost
        self.block_size = pool.spec.block_size
        # The tier's measured speed; until it is calibrated nothing is read back.
        self.speed: TierSpeed | None = None
        # Tier hits read back, and those left to be computed because that was cheaper.
        self.loaded_blocks = 0
        self.recomputed_blocks = 0
        # Bumped whenever blocks are dropped: KV staged before is not used after.
        self.epoch = 0
        self._budgets: dict[Owner, TierBudget] = {}

    def apply_budget(self, owner: Owner, budget: TierBudget) -> None:
        """Give the tier an owner's budget, unless it is the one given last."""
        if self._budgets.get(owner) != budget:
            self.tier.set_budget(owner, budget)
            self._budgets[owner] = budget

    def drop(self, keys: list[BlockHash]) -> None:
        """Forget these blocks in the tier (a public prefix was withdrawn, or a failed request's
        KV left the pool): queued offloads dropped, the entries whose ids this worker made
        deleted in the background (ids are keyed by data keys a drop does not carry:
        kv_tier.py), and nothing read back for them before now is written into a block any
        more."""
        self.epoch += 1
        self.tier.discard(keys)

    def offload(
        self, committed: list[tuple[int, Block]], request: CacheRequest, chain_blocks: int
    ) -> None:
        """Queue just-committed blocks ((index in the request's chain, block), in order) for
        the tier; the chain has `chain_blocks` full blocks.

        A block is worth what a hit on it saves: its own prefill and that of every block after
        it in the chain, which cannot be read back without it. So a chain's head is worth the
        most and its tail the least, and a full tier cuts chains from their tails (valued by
        its own prefill alone, a head, the cheapest position to compute, would go first and
        take the whole chain's use with it). Under "lru" each block counts as one.
        """
        keys = request.seal_keys
        if keys is None or not committed:
            return
        first = committed[0][0]
        costs = [self.block_cost(index) for index in range(first, chain_blocks)]
        # after[k]: what blocks first + k .. the chain's end save, together.
        after = list(itertools.accumulate(reversed(costs)))[::-1]
        for index, block in committed:
            saved_ms = after[index - first] if index - first < len(after) else 0.0
            if self.eviction == "lru":
                saved_ms = 1.0
            seal_key = None if block.scope is None else keys.for_scope(block.scope)
            if seal_key is None or block.key is None or block.owner is None:
                continue
            assert block.parent_key is not None and block.scope is not None
            kv = self.pool.kv[:, :, block.block_id].to("cpu", copy=True)
            value = value_per_byte(0, saved_ms, self.pool.spec.bytes_per_block)
            entry = TierBlock(
                block.key, block.parent_key, block.scope, block.token_bytes, block.owner
            )
            self.tier.offload(entry, seal_key, kv, value)

    def stage(self, request: CacheRequest, chain: KeyChain, start: int, limit: int) -> int:
        """Stage the blocks from `start` (the first the pool lacks) up to `limit` that the tier
        holds and that are cheaper to read than to compute; returns how many, in a row."""
        keys = request.seal_keys
        if keys is None or self.speed is None:
            return 0
        if chain.staged_epoch != self.epoch:  # blocks were dropped since: read them again
            chain.staged.clear()
            chain.staged_epoch = self.epoch
            chain.probed = -1
        limit = min(limit, start + MAX_STAGED_BLOCKS)
        staged = 0
        while start + staged < limit and start + staged in chain.staged:
            staged += 1
        first = start + staged
        if first >= limit or first == chain.probed:
            return staged  # a request that waits asks the tier about a block once
        chain.probed = first
        # Each block's id is keyed by its owner's data key: the public prefix's for the chain's
        # public blocks, the tenant's for the rest (no key: not in the tier).
        probed = chain.keys[first:limit]
        seal_keys = [keys.for_scope(scope) for scope in chain.scopes[first : first + len(probed)]]
        present = self.tier.contains(probed, seal_keys)
        run = next((i for i, held in enumerate(present) if not held), len(present))
        if not run:
            return staged
        recompute_ms = sum(self.block_cost(index) for index in range(first, first + run))
        if not self.speed.cheaper_than(run * self.pool.spec.bytes_per_block, recompute_ms):
            self.recomputed_blocks += run
            return staged
        wanted = [self._tier_block(request, chain, index) for index in range(first, first + run)]
        for offset, kv in enumerate(self.tier.load(wanted, seal_keys[:run], chain=True)):
            if kv is None:
                break
            chain.staged[first + offset] = kv
            staged += 1
            self.loaded_blocks += 1
        return staged

    def _tier_block(self, request: CacheRequest, chain: KeyChain, index: int) -> TierBlock:
        scope = chain.scopes[index]
        return TierBlock(
            chain.keys[index],
            chain.keys[index - 1] if index else self.root,
            scope,
            block_token_bytes(chain.token_bytes, index, self.block_size),
            owner_of(scope, request.tenant_id),
        )
