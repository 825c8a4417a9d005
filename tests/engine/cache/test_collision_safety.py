"""I3: a key hit whose stored tokens, scope or parent differ is a miss."""

from __future__ import annotations

import hashlib

from engine.cache.block_hash import HashObject
from engine.cache.budget import PUBLIC_OWNER, TenantBudget
from engine.cache.cache_request import CacheRequest
from engine.cache.scope import Public, Segment, Tenant, User
from tests.support.cache import make_manager, request, run_prompt


class _Digest:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def digest(self) -> bytes:
        return self._value


def constant_hash(data: bytes) -> HashObject:
    """Every key collides with every other."""
    return _Digest(b"\x00" * 32)


def tokens_only_hash(data: bytes) -> HashObject:
    """Ignores parent and scope: the last 16 bytes are one block's token ids (block size 4)."""
    return _Digest(hashlib.sha256(data[-16:]).digest())


def test_colliding_keys_with_different_tokens_are_misses() -> None:
    manager = make_manager(new_hash=constant_hash)
    run_prompt(manager, request("t1", list(range(13)), Tenant("t1")))
    assert run_prompt(manager, request("t1", list(range(50, 63)), Tenant("t1"))) == 0
    assert manager.prefix_cache.collisions > 0


def test_colliding_keys_with_different_scope_are_misses() -> None:
    manager = make_manager(new_hash=tokens_only_hash)
    run_prompt(manager, request("t1", list(range(13)), User("t1", "alice")))
    assert run_prompt(manager, request("t2", list(range(13)), User("t2", "mallory"))) == 0
    assert run_prompt(manager, request("t1", list(range(13)), User("t1", "alice"))) == 12


def test_colliding_keys_with_a_different_parent_are_misses() -> None:
    manager = make_manager(new_hash=tokens_only_hash)
    # Same second block after different first blocks: the tokens-only hash gives both the
    # same key for block 1, but block 1 of the second chain must not be served from the first.
    run_prompt(manager, request("t1", [1, 2, 3, 4, 9, 9, 9, 9, 0], Tenant("t1")))
    assert run_prompt(manager, request("t1", [5, 6, 7, 8, 9, 9, 9, 9, 0], Tenant("t1"))) == 0


def first_token_hash(data: bytes) -> HashObject:
    """Looks only at a block's first token id (block size 4), so [1,1,1,1] and [1,5,5,5] collide."""
    return _Digest(hashlib.sha256(data[-16:-12]).digest())


def test_child_of_an_evicted_parent_is_not_reachable_through_a_new_colliding_parent() -> None:
    manager = make_manager(new_hash=first_token_hash)

    def chat(tokens: list[int]) -> CacheRequest:
        segments = [Segment(0, 4, Public("ns")), Segment(4, len(tokens), Tenant("t1"))]
        return request("t1", tokens, Tenant("t1"), segments=segments)

    run_prompt(manager, chat([1, 1, 1, 1, 2, 2, 2, 2, 0]))  # caches A0 (public) -> A1 (t1)
    # Evict only A0: empty the public budget, then open it again.
    manager.set_budget(PUBLIC_OWNER, TenantBudget(0))
    manager.set_budget(PUBLIC_OWNER, TenantBudget(32))
    # B0 has other tokens but takes A0's old key.
    assert run_prompt(manager, chat([1, 5, 5, 5, 9])) == 0
    # B0 is a verified hit; A1 has the right tokens, scope and parent *key*, but its KV was
    # computed after A0's tokens, so it must not be served after B0.
    assert run_prompt(manager, chat([1, 5, 5, 5, 2, 2, 2, 2, 0])) == 4
