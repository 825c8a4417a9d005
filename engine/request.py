"""What callers hand the engine, and what streams back."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from typing import Any

from engine.cache.budget import PUBLIC_OWNER, TenantBudget
from engine.cache.cache_request import SOURCE_KINDS, SOURCE_TIERS, CacheLedger, SealKeys
from engine.cache.scope import NO_CACHE, CacheScope, Segment
from engine.sampling.sampler import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """Token ids plus the scopes the caller's policy gave them; the engine decides nothing else.

    `segments` tile the prompt; generated tokens take `tail_scope`. An empty `segments` means
    the whole prompt is `tail_scope`.
    """

    request_id: str
    tenant_id: str
    prompt_token_ids: abc.Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    segments: abc.Sequence[Segment] = ()
    tail_scope: CacheScope = NO_CACHE
    budget: TenantBudget | None = None
    # The tenant's scheduling weight: against other tenants with work, its share of the
    # engine's service is in proportion to it (engine/fairness.py).
    weight: float = 1.0
    # The compiled grammar the output must follow (`Engine.grammars.compile`), or None.
    grammar: Any = None
    # How many choices to generate from the prompt; they share its KV (computed once).
    n: int = 1
    # None, or k >= 0: the log probability of each prompt token after the first, with the k
    # likeliest tokens at its position. Every prompt position is then computed (no cache hit).
    prompt_logprobs: int | None = None
    # The data keys its blocks are sealed with in a second KV tier (None: it uses no tier).
    seal_keys: SealKeys | None = None

    def prompt_segments(self) -> list[Segment]:
        if self.segments:
            return list(self.segments)
        return [Segment(0, len(self.prompt_token_ids), self.tail_scope)]


@dataclass(frozen=True, slots=True)
class CacheSources:
    """What the cache did for a request: its cached prompt tokens by source (its own private
    scope, its tenant's, a public prefix; read from the pool or the second tier), the blocks
    and bytes it loaded from the tier, and the blocks its allocations evicted, per owner (a
    tenant id, or "public")."""

    cached: dict[str, int] = field(default_factory=dict)  # "own.pool", "public.tier", ...
    tier_loads: int = 0
    tier_bytes: int = 0
    evicted: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, ledger: CacheLedger, block_size: int) -> CacheSources:
        """A request's ledger as its usage reports it, in tokens; every source is named."""
        cached = {
            f"{kind}.{tier}": ledger.sources[kind, tier] * block_size
            for kind in SOURCE_KINDS
            for tier in SOURCE_TIERS
        }
        evicted = {
            "public" if owner is PUBLIC_OWNER else str(owner): count
            for owner, count in ledger.evicted.items()
        }
        return cls(cached, ledger.tier_loads, ledger.tier_bytes, evicted)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request, as the OpenAI `usage` object reports it."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Where the cached tokens came from (choice 0 only: the prompt is counted once).
    cache: CacheSources | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall-clock seconds (time.time()) of a request's phases, for tracing."""

    arrived: float
    admitted: float
    first_token: float
    finished: float


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """New output of one choice since its last delta; a choice's last delta has
    `finish_reason`, `usage` (the prompt counted on choice 0 only) and `timings`."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # One per token of `token_ids`, when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # On a choice's first delta, when the request asked for prompt logprobs: one per prompt
    # token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Which choice (0..n-1) the delta belongs to; each choice ends with a delta of its own.
    index: int = 0
    usage: Usage | None = None
    timings: Timings | None = None
