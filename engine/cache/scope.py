"""Cache scopes: who may reuse a cached block, and which scope each block of a request takes.

A scope is part of every block key (`block_hash.encode_scope` gives its bytes), so two requests
can only share a block when their plans give that block the same scope. The engine never
decides scopes; it receives them with each request as segments over the token ids and derives
one scope per block from them.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from engine.math_utils import cdiv


@dataclass(frozen=True, slots=True)
class Public:
    """Shared by every tenant allowed to use admin-registered prefixes in this namespace."""

    namespace: str


@dataclass(frozen=True, slots=True)
class Tenant:
    """Shared by all users of one tenant (the tenant opted into tenant-wide sharing)."""

    tenant_id: str


@dataclass(frozen=True, slots=True)
class User:
    """Shared only by one end user of one tenant: the default private scope."""

    tenant_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class NoCache:
    """Never matched and never committed to the prefix cache."""


CacheScope = Public | Tenant | User | NoCache
NO_CACHE = NoCache()

# Higher is more private. A block takes the most private scope of any token in it.
_PRIVACY = {Public: 0, Tenant: 1, User: 2, NoCache: 3}


def privacy(scope: CacheScope) -> int:
    """Rank a scope: 0 for public, up to 3 for no caching at all."""
    return _PRIVACY[type(scope)]


def more_private(a: CacheScope, b: CacheScope) -> CacheScope:
    """Return the more private of two scopes; two different scopes of one rank are an error."""
    rank_a, rank_b = privacy(a), privacy(b)
    if rank_a == rank_b and a != b:
        raise ValueError(f"conflicting scopes in one request: {a} and {b}")
    return a if rank_a >= rank_b else b


def no_less_private(scope: CacheScope, previous: CacheScope) -> CacheScope:
    """The scope of a block after one scoped `previous`: `scope`, but never less private.

    Once a chain of blocks turns private it stays private, so `previous` wins when it is the
    more private of the two.
    """
    return scope if privacy(scope) >= privacy(previous) else previous


def _merge(current: CacheScope | None, scope: CacheScope) -> CacheScope:
    return scope if current is None else more_private(current, scope)


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens [start, end) of a request share one scope."""

    start: int
    end: int
    scope: CacheScope


def block_scopes(
    segments: abc.Sequence[Segment], num_tokens: int, block_size: int, tail_scope: CacheScope
) -> list[CacheScope]:
    """One scope per block covering `num_tokens` tokens (the last block may be partial).

    Tokens no segment covers (generated text) take `tail_scope`. Each block takes the most
    private scope of its tokens, and is never less private than the block before it.
    """
    num_blocks = cdiv(num_tokens, block_size)
    scopes: list[CacheScope | None] = [None] * num_blocks
    covered = 0
    for segment in sorted(segments, key=lambda s: s.start):
        if segment.start != covered or segment.end <= segment.start:
            raise ValueError(f"segments must tile the tokens without gaps: {segment}")
        covered = segment.end
        first = segment.start // block_size
        last = min(cdiv(segment.end, block_size), num_blocks)
        for index in range(first, last):
            scopes[index] = _merge(scopes[index], segment.scope)
    if covered < num_tokens:
        for index in range(covered // block_size, num_blocks):
            scopes[index] = _merge(scopes[index], tail_scope)
    result: list[CacheScope] = []
    for scope in scopes:
        assert scope is not None
        result.append(no_less_private(scope, result[-1]) if result else scope)
    return result
