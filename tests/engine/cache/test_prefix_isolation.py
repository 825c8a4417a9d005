"""I2: a chain cached under one scope is never matched under another."""

from __future__ import annotations

import pytest

from engine.cache.scope import NO_CACHE, CacheScope, Public, Segment, Tenant, User
from tests.support.cache import BLOCK_SIZE, make_manager, request, run_prompt

PROMPT = list(range(100, 121))  # 5 full blocks and one token more


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        (("t1", User("t1", "alice")), ("t2", User("t2", "alice"))),
        (("t1", User("t1", "alice")), ("t1", User("t1", "bob"))),
        (("t1", Tenant("t1")), ("t2", Tenant("t2"))),
        (("t1", Tenant("t1")), ("t1", User("t1", "alice"))),
        (("t1", User("t1", "alice")), ("t1", Tenant("t1"))),
        (("t1", User("t1", "alice")), ("t1", Public("ns"))),
        (("t1", Public("ns")), ("t2", User("t2", "alice"))),
        (("t1", Public("ns")), ("t2", Public("other-ns"))),
    ],
    ids=[
        "user-across-tenants",
        "user-across-users",
        "tenant-across-tenants",
        "tenant-to-user",
        "user-to-tenant",
        "private-to-public",
        "public-to-private",
        "public-across-namespaces",
    ],
)
def test_chain_never_matches_under_another_scope(
    writer: tuple[str, CacheScope], reader: tuple[str, CacheScope]
) -> None:
    manager = make_manager()
    run_prompt(manager, request(writer[0], PROMPT, writer[1]))
    assert run_prompt(manager, request(*reader[:1], PROMPT, reader[1])) == 0
    # The same scope again does hit: the miss above is isolation, not a broken cache.
    assert run_prompt(manager, request(writer[0], PROMPT, writer[1])) == 5 * BLOCK_SIZE


def test_public_prefix_is_shared_across_tenants_but_private_suffix_is_not() -> None:
    manager = make_manager()
    system = list(range(8))
    public = Public("ns")

    def chat(tenant: str, user: str, suffix: list[int]) -> int:
        segments = [Segment(0, 8, public), Segment(8, 8 + len(suffix), User(tenant, user))]
        req = request(tenant, system + suffix, User(tenant, user), segments=segments)
        return run_prompt(manager, req)

    assert chat("t1", "alice", list(range(50, 63))) == 0
    assert chat("t2", "bob", list(range(50, 63))) == 8  # the public blocks only
    assert chat("t1", "alice", list(range(50, 63))) == 20  # everything but the last token


def test_no_cache_requests_neither_hit_nor_leave_anything_behind() -> None:
    manager = make_manager()
    run_prompt(manager, request("t1", PROMPT, NO_CACHE))
    assert len(manager.prefix_cache) == 0
    run_prompt(manager, request("t1", PROMPT, User("t1", "alice")))
    assert run_prompt(manager, request("t1", PROMPT, NO_CACHE)) == 0


def test_last_prompt_token_is_always_recomputed() -> None:
    manager = make_manager()
    exact = list(range(16))  # exactly four blocks
    run_prompt(manager, request("t1", exact, Tenant("t1")))
    assert run_prompt(manager, request("t1", exact, Tenant("t1"))) == 12


def test_disabled_prefix_caching_never_hits() -> None:
    manager = make_manager(enable_prefix_caching=False)
    run_prompt(manager, request("t1", PROMPT, Tenant("t1")))
    assert run_prompt(manager, request("t1", PROMPT, Tenant("t1"))) == 0
    assert len(manager.prefix_cache) == 0
