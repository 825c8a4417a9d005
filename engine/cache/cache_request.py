"""What the KV cache manager is told about a request, and what it keeps about one."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field

from engine.cache.block_hash import BlockHash
from engine.cache.block_pool import Block
from engine.cache.budget import TenantBudget
from engine.cache.scope import NO_CACHE, CacheScope, Segment, block_scopes
from engine.math_utils import cdiv


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What the manager needs to know about a request: tokens, scopes, who pays."""

    request_id: str
    tenant_id: str
    prompt_token_ids: abc.Sequence[int]
    segments: abc.Sequence[Segment]
    # Scope of the tokens no segment covers: the generated text.
    tail_scope: CacheScope = NO_CACHE
    budget: TenantBudget | None = None
    # False: compute every prompt position, hitting no cached block (its blocks are still
    # cached for others).
    reuse: bool = True


@dataclass(slots=True, eq=False)
class CacheSequence:
    """The manager's record of an admitted request: its tokens, blocks and keys."""

    request: CacheRequest
    token_bytes: bytearray
    scopes: list[CacheScope]
    blocks: list[Block] = field(default_factory=list)
    keys: list[BlockHash] = field(default_factory=list)
    cached_tokens: int = 0
    committed_blocks: int = 0
    # The cached block the next committed block extends (None: the chain's root).
    chain_parent: Block | None = None
    commit_stopped: bool = False


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The verified cached prefix of a request, valid until the cache next changes.

    Callers read `blocks` and `cached_tokens` and hand the match to `KVCacheManager.admit`;
    the rest is the manager's own: its record of the request (with the keys `match` computed)
    and the blocks' generations, which `admit` checks so that a stale match is refused.
    """

    blocks: list[Block]
    block_size: int
    _record: CacheSequence = field(repr=False)
    _generations: list[int] = field(repr=False)

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size


def request_block_scopes(request: CacheRequest, block_size: int) -> list[CacheScope]:
    """One scope per prompt block; raises ValueError for segments that cannot be honoured.

    The prompt's last block is scoped as if generation filled it: its tail belongs to the
    generated text.
    """
    if not request.prompt_token_ids:
        raise ValueError("a request needs at least one prompt token")
    padded = cdiv(len(request.prompt_token_ids), block_size) * block_size
    return block_scopes(request.segments, padded, block_size, request.tail_scope)
