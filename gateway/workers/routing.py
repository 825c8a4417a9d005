"""Which worker serves a request: the longest cached prefix under the request's own scopes,
weighed against load.

A request's block keys are computed here exactly as its worker will compute them: the same
hash chain over the same token ids and the same scopes (engine/cache/block_hash.py), then
digested under the key workers publish theirs with (key_log.py). Scope is part
of every key, so a tenant's request can only match blocks its own policy may reuse: another
tenant's private prefix never attracts it, while a public system prompt or a user's own earlier
turns draw it to the worker that holds them. Routing sees keys and scopes, never text.

The cost of sending a request to a worker, in prompt tokens to compute:

    cost = uncached prompt tokens
         + routing_load_tokens x (its tenant's sequences in flight there
                                  + other tenants with work there)
         + tokens of blocks it would have to evict (more than its free blocks)

The middle term is the queue the request would wait in there. A worker's engine schedules
fairly between tenants: a request waits for its own tenant's work and for about one share of
each other tenant with work there, not for every other tenant's request. So a tenant's flood
weighs on that tenant's own requests, which spread over the workers by it, while another
tenant sees one more tenant there and keeps going to the worker that holds its prefix. (A worker
that does not report its tenants counts every sequence in flight there.)

The cheapest worker wins. Ties (nothing cached anywhere, equal load) go to a worker chosen by
rendezvous hashing on the request's first block key, so the turns of one conversation and the
requests of one system prompt keep landing together. When the cheapest worker's queue for the
request is `max_imbalance` longer than the shortest one, the least loaded wins: a hot prefix
must not pile every request onto one machine.
"""

from __future__ import annotations

import hashlib
from collections import abc
from dataclasses import dataclass

from engine.cache.block_hash import BlockHash, BlockHasher, encode_token_ids
from engine.cache.scope import block_scopes
from engine.math_utils import cdiv
from engine.request import GenerationRequest
from gateway.workers.key_log import KeyDigest


def request_keys(
    request: GenerationRequest, root: bytes, block_size: int, digest: KeyDigest
) -> list[str]:
    """The published form (`digest`) of the keys of the request's prompt blocks a worker
    could serve from cache (every full block before the last prompt token, up to the first
    uncacheable one)."""
    if request.prompt_logprobs is not None:
        return []  # computed in full whatever is cached
    tokens = request.prompt_token_ids
    limit = (len(tokens) - 1) // block_size
    if limit <= 0:
        return []
    scopes = block_scopes(request.prompt_segments(), len(tokens), block_size, request.tail_scope)
    chain = BlockHasher(block_size).chain(
        BlockHash(root), encode_token_ids(tokens), scopes, end_block=limit
    )
    return [digest(key) for key in chain]


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a gateway picks among workers (its `routing*` settings)."""

    mode: str  # "cache_aware" or "round_robin"
    load_tokens: int  # what one request in flight costs, in prompt tokens to compute
    max_imbalance: int  # the least loaded wins once the cheapest's queue is this much longer


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as routing sees it."""

    name: str
    keys: abc.Container[str]  # cached, or about to be (requests just sent there)
    load: int  # the queue the request would wait in there, in sequences (`Worker.load_for`)
    free_blocks: int
    # The request's keys as this worker computes them (its root: model, KV dtype, block size).
    request_keys: abc.Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    name: str
    cached_blocks: int  # leading blocks of the request the worker is expected to hold


def matched_blocks(keys: abc.Sequence[str], held: abc.Container[str]) -> int:
    """How many of `keys`, from the first, `held` contains."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count


def rank(
    candidates: abc.Sequence[Candidate],
    prompt_tokens: int,
    block_size: int,
    load_tokens: int,
    max_imbalance: int,
    sticky: str,
) -> list[Choice]:
    """Every candidate, best first (the rest are where a failed attempt goes next)."""
    if not candidates:
        return []
    needed_blocks = cdiv(prompt_tokens, block_size)
    least_loaded = min(candidate.load for candidate in candidates)
    scored: list[tuple[float, int, Choice]] = []
    for candidate in candidates:
        cached = matched_blocks(candidate.request_keys, candidate.keys)
        uncached = max(0, prompt_tokens - cached * block_size)
        evict = max(0, needed_blocks - cached - candidate.free_blocks) * block_size
        cost = uncached + load_tokens * candidate.load + evict
        scored.append((cost, -_rendezvous(sticky, candidate.name), Choice(candidate.name, cached)))
    scored.sort(key=lambda item: (item[0], item[1]))
    ranked = [choice for _, _, choice in scored]
    loads = {candidate.name: candidate.load for candidate in candidates}
    if loads[ranked[0].name] - least_loaded >= max_imbalance:
        ranked.sort(key=lambda choice: loads[choice.name])  # stable: best among least loaded
    return ranked


def rotate(candidates: abc.Sequence[Candidate], turn: int) -> list[Choice]:
    """Round robin, for comparison: the candidates starting at `turn`."""
    if not candidates:
        return []
    start = turn % len(candidates)
    ordered = [*candidates[start:], *candidates[:start]]
    return [Choice(candidate.name, 0) for candidate in ordered]


def _rendezvous(sticky: str, name: str) -> int:
    digest = hashlib.blake2b(f"{sticky}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
