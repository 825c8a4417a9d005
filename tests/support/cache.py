"""Small KV cache managers and requests for engine-core tests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine.cache.block_hash import DEFAULT_HASH, BlockHasher, HashConstructor
from engine.cache.block_pool import BlockPool
from engine.cache.budget import TenantBudget
from engine.cache.cache_request import CacheRequest
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope, Segment

BLOCK_SIZE = 4
_ids = itertools.count()


def make_manager(
    num_blocks: int = 32,
    block_size: int = BLOCK_SIZE,
    new_hash: HashConstructor = DEFAULT_HASH,
    public_budget: TenantBudget | None = None,
    enable_prefix_caching: bool = True,
) -> KVCacheManager:
    """A manager over a tiny pool: 2 layers, 2 KV heads, head size 4, fp32."""
    spec = KVSpec(
        num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=block_size
    )
    pool = BlockPool(spec, num_blocks)
    hasher = BlockHasher(block_size, new_hash)
    root = hasher.root("test-model", "", "float32")
    return KVCacheManager(
        pool, hasher, root, public_budget=public_budget, enable_prefix_caching=enable_prefix_caching
    )


def request(
    tenant_id: str,
    tokens: Sequence[int],
    scope: CacheScope,
    segments: Sequence[Segment] | None = None,
    tail_scope: CacheScope | None = None,
    budget: TenantBudget | None = None,
) -> CacheRequest:
    """A request whose whole prompt (and generated text) carries `scope` unless told otherwise."""
    return CacheRequest(
        request_id=f"req-{next(_ids)}",
        tenant_id=tenant_id,
        prompt_token_ids=list(tokens),
        segments=list(segments) if segments is not None else [Segment(0, len(tokens), scope)],
        tail_scope=tail_scope if tail_scope is not None else scope,
        budget=budget,
    )


def run_prompt(manager: KVCacheManager, req: CacheRequest, free: bool = True) -> int:
    """Admit, 'compute' the whole prompt, commit, optionally free; returns cached tokens."""
    hit = manager.match(req)
    refusal = manager.admit(hit, len(req.prompt_token_ids) - hit.cached_tokens)
    assert refusal is None, refusal
    manager.commit(req.request_id, len(req.prompt_token_ids))
    if free:
        manager.free(req.request_id)
        manager.end_step()
    return hit.cached_tokens


def fill_blocks(manager: KVCacheManager, request_id: str, value: float = 7.0) -> list[int]:
    """Write non-zero KV data into a request's blocks, as a forward pass would."""
    block_ids = manager.block_ids(request_id)
    manager.pool.kv[:, :, block_ids] = value
    return block_ids


def blocks_are_zero(manager: KVCacheManager, block_ids: Sequence[int]) -> bool:
    return bool((manager.pool.kv[:, :, list(block_ids)] == 0).all())
