"""What the KV cache manager is told about a request, and what it keeps about one.

A request's tokens are keyed once: its `KeyChain` (token bytes, one scope per block, the keys
computed so far) is made when the request is submitted and kept by the request for its whole
life, through admission attempts that are refused, preemption and re-admission. The manager
extends the chain's keys only past what it computed before, so a request that waits many
steps, or is preempted and comes back, hashes each of its blocks once.
"""

from __future__ import annotations

from collections import Counter, abc
from dataclasses import dataclass, field

import torch

from engine.cache.block_hash import TOKEN_ID_BYTES, BlockHash, encode_token_ids
from engine.cache.block_pool import Block
from engine.cache.budget import Owner, TenantBudget
from engine.cache.scope import (
    NO_CACHE,
    CacheScope,
    Public,
    Segment,
    Tenant,
    block_scopes,
    no_less_private,
)
from engine.cache.tier.sealing import SealKey
from engine.math_utils import cdiv


@dataclass(frozen=True, slots=True)
class SealKeys:
    """The data keys a request's blocks are sealed with in the second tier: its tenant's,
    and that of the public prefix its public span matched (None: it matched none)."""

    tenant: SealKey
    public: SealKey | None = None

    def for_scope(self, scope: CacheScope) -> SealKey | None:
        """The key a block of this scope is sealed with (None: it is not sealed at all)."""
        return self.public if isinstance(scope, Public) else self.tenant


# Where a cached prompt block came from: its scope's kind, and the tier that held it.
SOURCE_KINDS = ("own", "tenant", "public")
SOURCE_TIERS = ("pool", "tier")


def source_kind(scope: CacheScope) -> str:
    """A cached block's source as the audit names it: the requester's own private scope,
    its tenant's shared scope, or a public prefix."""
    if isinstance(scope, Public):
        return "public"
    return "tenant" if isinstance(scope, Tenant) else "own"


@dataclass(slots=True, eq=False)
class CacheLedger:
    """What the cache did for one request: where its cached prompt blocks came from at its
    latest admission, what it loaded from the second tier, and the blocks its allocations
    evicted, per owner, over its whole life (preemptions included)."""

    # (source kind, "pool" or "tier") -> cached blocks, at the latest admission.
    sources: Counter[tuple[str, str]] = field(default_factory=Counter)
    tier_loads: int = 0
    tier_bytes: int = 0
    evicted: Counter[Owner] = field(default_factory=Counter)


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
    # The keys its blocks are sealed with in the second tier (None: it never uses the tier).
    seal_keys: SealKeys | None = None
    ledger: CacheLedger = field(default_factory=CacheLedger, compare=False)


@dataclass(slots=True, eq=False)
class KeyChain:
    """A request's tokens as the cache keys them: their bytes (`encode_token_ids`), one scope
    per block, and the keys of its first blocks, computed by the manager as it needs them.

    Tokens are only ever appended, and a block's key depends only on the blocks before it, so
    keys once computed stay valid for the request's whole life.
    """

    token_bytes: bytearray
    scopes: list[CacheScope]
    tail_scope: CacheScope
    keys: list[BlockHash] = field(default_factory=list)
    # Blocks (by index) read back from the second tier and not yet admitted: their KV, loaded
    # once however many times the request is matched while it waits.
    staged: dict[int, torch.Tensor] = field(default_factory=dict)
    staged_epoch: int = 0  # the tier link's epoch the staged blocks were read in
    probed: int = -1  # the block the tier was last asked about from (-1: none)
    # Blocks (by index) whose KV came from the second tier at the latest admission.
    from_tier: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, request: CacheRequest, block_size: int) -> KeyChain:
        """The chain of a request's prompt, no key computed yet; raises ValueError for
        segments that cannot be honoured."""
        scopes = request_block_scopes(request, block_size)
        token_bytes = bytearray(encode_token_ids(request.prompt_token_ids))
        return cls(token_bytes, scopes, request.tail_scope)

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // TOKEN_ID_BYTES

    def append(self, token_ids: abc.Sequence[int]) -> None:
        """Add generated tokens, so that their full blocks can be keyed and committed."""
        self.token_bytes += encode_token_ids(token_ids)

    def extend_scopes(self, num_blocks: int) -> None:
        """Scopes for blocks of generated text: the tail scope, never less private."""
        while len(self.scopes) < num_blocks:
            self.scopes.append(no_less_private(self.tail_scope, self.scopes[-1]))

    def copy(self) -> KeyChain:
        """A chain of its own over the same tokens (another choice of the same prompt)."""
        return KeyChain(
            bytearray(self.token_bytes), list(self.scopes), self.tail_scope, list(self.keys)
        )  # staged and from_tier are the original's: the copy is another request's


@dataclass(slots=True, eq=False)
class CacheSequence:
    """The manager's record of an admitted request: its key chain, blocks and commits."""

    request: CacheRequest
    chain: KeyChain
    blocks: list[Block] = field(default_factory=list)
    cached_tokens: int = 0
    committed_blocks: int = 0
    # The cached block the next committed block extends (None: the chain's root).
    commit_parent: Block | None = None
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
    # Blocks after `blocks` whose KV the second tier gave back (staged on the chain), which
    # `admit` writes into blocks of the request's own.
    tier_blocks: int = 0

    @property
    def cached_tokens(self) -> int:
        return (len(self.blocks) + self.tier_blocks) * self.block_size


def request_block_scopes(request: CacheRequest, block_size: int) -> list[CacheScope]:
    """One scope per prompt block; raises ValueError for segments that cannot be honoured.

    The prompt's last block is scoped as if generation filled it: its tail belongs to the
    generated text.
    """
    if not request.prompt_token_ids:
        raise ValueError("a request needs at least one prompt token")
    padded = cdiv(len(request.prompt_token_ids), block_size) * block_size
    return block_scopes(request.segments, padded, block_size, request.tail_scope)
