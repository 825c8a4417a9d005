"""Checks at submission: a request that can never be served is refused at once, typed.

Each check looks only at the request and at what waiting cannot change (the vocabulary, the
context length, the pool's size, the budget that comes with the request), so a refusal here
never turns away a request that waiting would have served, and a request that passes is never
left to wait for a queue timeout that retrying could not avoid.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.cache_request import CacheRequest, KeyChain
from engine.cache.kv_cache_manager import KVCacheManager
from engine.errors import ContextTooLong, ExceedsCacheQuota, InvalidRequest
from engine.request import GenerationRequest
from engine.sampling.sampler import MAX_TOP_LOGPROBS
from engine.sequence import cache_request

# Choices per request the engine takes; gateways set their own, lower limit.
MAX_CHOICES = 128


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the model accepts: token ids below `vocab_size`, `max_model_len` tokens in all."""

    vocab_size: int
    max_model_len: int
    has_tokenizer: bool


def validate(
    request: GenerationRequest, limits: ModelLimits, cache: KVCacheManager
) -> tuple[CacheRequest, KeyChain]:
    """Raise `InvalidRequest` (or a subclass) if the request can never be served; else return
    what the cache manager is told of it and its prompt's key chain (no key computed yet),
    made here once for the request's whole life."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if not 1 <= request.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")
    if not (math.isfinite(request.weight) and request.weight > 0):
        raise InvalidRequest("the scheduling weight must be a positive number", param="weight")
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
        message = f"prompt logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
        raise InvalidRequest(message, param="logprobs")
    vocab = limits.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")
    outside = [token for token, _ in request.sampling.logit_bias if token >= vocab]
    if outside:
        message = f"logit_bias: token id {outside[0]} is not below the vocabulary size {vocab}"
        raise InvalidRequest(message, param="logit_bias")
    max_tokens = request.sampling.max_tokens
    if len(prompt) + max_tokens > limits.max_model_len:
        raise ContextTooLong(
            f"this model's maximum context length is {limits.max_model_len} tokens; the "
            f"request asks for {len(prompt)} prompt + {max_tokens} completion tokens"
        )
    if request.sampling.stop and not limits.has_tokenizer:
        raise InvalidRequest("stop strings need a model with a tokenizer", param="stop")
    as_cache = cache_request(request)
    try:
        chain = KeyChain.of(as_cache, cache.block_size)
    except ValueError as error:
        raise InvalidRequest(f"bad cache scopes: {error}") from error
    check_fits(request, as_cache, chain, cache)
    return as_cache, chain


def check_fits(
    request: GenerationRequest, as_cache: CacheRequest, chain: KeyChain, cache: KVCacheManager
) -> None:
    """Raise `ExceedsCacheQuota` if the request's KV could never be held at once.

    A running request holds every one of its blocks (cache hits included) until it ends, so it
    can run only if each owner's share fits that owner's quota and the total fits the pool.
    """
    prompt_len = len(request.prompt_token_ids)
    # The last sampled token is never fed back: KV holds at most this many positions.
    positions = prompt_len + request.sampling.max_tokens - 1
    excess = _excess(request, cache, cache.blocks_charged(as_cache, chain, positions))
    if excess is None:
        return
    owner, needed_blocks, limit_blocks = excess
    # Whether a smaller max_tokens could help, or the prompt alone is too big.
    prompt_excess = _excess(request, cache, cache.blocks_charged(as_cache, chain, prompt_len))
    param, fix = (
        ("max_tokens", "lower max_tokens")
        if prompt_excess is None
        else ("messages", "shorten the prompt")
    )
    block = cache.block_size
    needed, limit = needed_blocks * block, limit_blocks * block
    counted = "prompt plus max_tokens"
    if owner is None:
        what, limit_text = "the request", f"the server's KV cache holds only {limit} tokens"
    elif owner is PUBLIC_OWNER:
        what, limit_text = "its shared public prefix", f"the public cache budget is {limit} tokens"
        fix = "ask the operator for a larger public cache budget"
    else:  # the message never names the tenant: its id is internal, the caller adds its name
        what, limit_text = "the request", f"the tenant's cache quota is {limit} tokens"
        counted += ", beyond a shared public prefix"
        fix += " or ask the operator for a larger cache quota"
    raise ExceedsCacheQuota(
        f"{what} needs {needed} tokens of KV cache ({counted}, in whole blocks of "
        f"{block} tokens) but {limit_text}; retrying cannot help: {fix}",
        needed_tokens=needed,
        quota_tokens=limit,
        param=param,
    )


def _excess(
    request: GenerationRequest, cache: KVCacheManager, charged: Counter[Owner]
) -> tuple[Owner | None, int, int] | None:
    """The first limit `charged` exceeds: (owner, or None for the pool; blocks; limit)."""
    for owner, blocks in charged.items():
        if owner == request.tenant_id and request.budget is not None:
            quota = request.budget.quota_blocks  # applied when the request is admitted
        else:
            quota = cache.budget(owner).quota_blocks
        if blocks > quota:
            return owner, blocks, quota
    if charged.total() > cache.pool.num_blocks:
        return None, charged.total(), cache.pool.num_blocks
    return None
