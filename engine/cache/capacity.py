"""Capacity planning: KV memory and prefill work with and without a shared prefix."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.cache.kv_spec import KVSpec
from engine.math_utils import cdiv


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What N requests sharing a prefix cost, with and without prefix sharing."""

    kv_bytes_per_token: int
    kv_bytes_per_prefix: int
    shareable_prefix_tokens: int
    prefix_copies_unshared_bytes: int
    unshared_bytes: int
    shared_bytes: int
    fresh_prefill_tokens_uncached: int
    fresh_prefill_tokens_cached: int
    avoided_prefill_tokens: int
    avoided_fraction: float

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


def plan_capacity(
    spec: KVSpec, prefix_tokens: int, suffix_tokens: int, requests: int
) -> CapacityPlan:
    """Plan `requests` requests of one shared prefix plus a unique suffix each.

    Memory is counted in whole blocks, as the pool hands it out. Only the prefix's full
    blocks can be shared, and never the prompt's last token (its logits are needed). The
    cached figure includes one warm-up request that computes the prefix first.
    """
    if prefix_tokens < 0 or suffix_tokens < 0 or requests < 0:
        raise ValueError("token counts and requests must not be negative")
    if prefix_tokens + suffix_tokens == 0:
        raise ValueError("a request needs at least one token")
    block = spec.block_size
    prompt_tokens = prefix_tokens + suffix_tokens
    shareable = min(prefix_tokens // block, (prompt_tokens - 1) // block) * block
    blocks_per_request = cdiv(prompt_tokens, block)
    unshared_blocks = requests * blocks_per_request
    shared_blocks = shareable // block + requests * (blocks_per_request - shareable // block)
    uncached = requests * prompt_tokens
    cached = (prefix_tokens if requests else 0) + requests * (prompt_tokens - shareable)
    per_block = spec.bytes_per_block
    return CapacityPlan(
        kv_bytes_per_token=spec.bytes_per_token,
        kv_bytes_per_prefix=spec.bytes_per_token * prefix_tokens,
        shareable_prefix_tokens=shareable,
        prefix_copies_unshared_bytes=requests * spec.bytes_per_token * prefix_tokens,
        unshared_bytes=unshared_blocks * per_block,
        shared_bytes=shared_blocks * per_block,
        fresh_prefill_tokens_uncached=uncached,
        fresh_prefill_tokens_cached=cached,
        avoided_prefill_tokens=uncached - cached,
        avoided_fraction=(uncached - cached) / uncached if uncached else 0.0,
    )
