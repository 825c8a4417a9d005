"""Eviction by value (and LRU kept for comparison): which idle block goes, never whose or how
many (`Quotas.plan` still decides that, see test_quotas.py)."""

from __future__ import annotations

import pytest

from engine.cache.block_pool import Block
from engine.cache.budget import PUBLIC_OWNER, Owner, QuotaExceeded, TenantBudget
from engine.cache.eviction import EvictionPolicy
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.scope import Public, Segment, Tenant
from tests.support.cache import make_manager, request, run_prompt
from tests.support.models import engine_for

POLICIES: list[EvictionPolicy] = ["value", "lru"]


def manager_with(eviction: EvictionPolicy, num_blocks: int) -> KVCacheManager:
    manager = make_manager(num_blocks=num_blocks)
    manager.quotas.set_eviction(eviction)
    return manager


def prompt(first_token: int, full_blocks: int) -> list[int]:
    """`full_blocks` full blocks of 4 tokens and one more token (the partial block that is
    freed, not cached)."""
    return list(range(first_token, first_token + 4 * full_blocks + 1))


def run(manager: KVCacheManager, tenant: str, tokens: list[int], times: int = 1) -> None:
    for _ in range(times):
        run_prompt(manager, request(tenant, tokens, Tenant(tenant)))


def cached(manager: KVCacheManager, tenant: str, tokens: list[int]) -> int:
    """Tokens of `tokens` a request of `tenant` would find cached now."""
    return manager.match(request(tenant, tokens, Tenant(tenant))).cached_tokens


def idle(manager: KVCacheManager, owner: Owner) -> list[Block]:
    return manager.pool.idle_blocks(owner)


@pytest.mark.parametrize("eviction", POLICIES)
def test_value_keeps_a_block_reused_often_over_a_newer_block_used_once(
    eviction: EvictionPolicy,
) -> None:
    manager = manager_with(eviction, num_blocks=6)
    reused, once = prompt(0, 2), prompt(100, 2)
    run(manager, "t1", reused, times=4)  # cached once, then three hits
    run(manager, "t1", once)  # newer, never hit
    run(manager, "t1", prompt(200, 3))  # four blocks, two free: two evictions
    if eviction == "value":
        assert (cached(manager, "t1", reused), cached(manager, "t1", once)) == (8, 0)
    else:  # LRU drops the older chain, however often it was used
        assert (cached(manager, "t1", reused), cached(manager, "t1", once)) == (0, 8)


def test_a_leaf_goes_before_its_parent_even_when_the_parent_is_worth_less() -> None:
    manager = manager_with("value", num_blocks=3)
    chain = prompt(0, 2)
    run(manager, "t1", chain)
    parent, leaf = sorted(idle(manager, "t1"), key=lambda block: block.position)
    assert parent.priority < leaf.priority  # a later block costs more to recompute
    run(manager, "t1", prompt(100, 1))  # two blocks, one free: one eviction
    assert parent.key is not None and leaf.key is None
    assert cached(manager, "t1", chain) == 4


def test_a_public_block_extended_only_by_tenants_blocks_is_its_owners_leaf() -> None:
    manager = make_manager(num_blocks=32, public_budget=TenantBudget(quota_blocks=3))
    shared = list(range(13))  # two public blocks, one tenant block, one partial
    segments = [Segment(0, 8, Public("ns")), Segment(8, 13, Tenant("t1"))]
    run_prompt(manager, request("t1", shared, Tenant("t1"), segments=segments))
    head, tail = sorted(idle(manager, PUBLIC_OWNER), key=lambda block: block.position)
    assert tail.children == 0 and head.children == 1  # t1's block is not the public's child
    other = [Segment(0, 8, Public("ns")), Segment(8, 9, Tenant("t2"))]
    run_prompt(manager, request("t2", list(range(100, 109)), Tenant("t2"), segments=other))
    # The public chain is cut from its tail, though the tail is what t1's block extends.
    assert head.key is not None and tail.key is None
    assert manager.counters(PUBLIC_OWNER).evicted_own_blocks == 1


@pytest.mark.parametrize("reserved", [0, 4])
def test_pressure_takes_the_least_valuable_block_of_owners_above_their_reservation(
    reserved: int,
) -> None:
    manager = manager_with("value", num_blocks=12)
    manager.set_budget("t1", TenantBudget(quota_blocks=12, reserved_blocks=reserved))
    run(manager, "t1", prompt(0, 4))  # four blocks never hit: worth the least
    run(manager, "t2", prompt(100, 3), times=3)  # three blocks, each hit twice
    run(manager, "t3", prompt(200, 6))  # seven blocks, five free: two evictions
    t1, t2 = manager.counters("t1"), manager.counters("t2")
    if reserved:  # t1 holds no more than it reserved: t3's pressure cannot touch it
        assert (len(idle(manager, "t1")), t1.evicted_blocks) == (4, 0)
        assert (len(idle(manager, "t2")), t2.evicted_pressure_blocks) == (1, 2)
    else:
        assert (len(idle(manager, "t1")), t1.evicted_pressure_blocks) == (2, 2)
        assert (len(idle(manager, "t2")), t2.evicted_blocks) == (3, 0)


@pytest.mark.parametrize("eviction", POLICIES)
def test_quota_refusal_is_typed_and_changes_nothing_under_either_policy(
    eviction: EvictionPolicy,
) -> None:
    manager = manager_with(eviction, num_blocks=16)
    manager.set_budget("t1", TenantBudget(quota_blocks=4))
    run(manager, "t1", prompt(0, 2), times=2)
    pool = manager.pool

    def everything() -> object:
        blocks = [
            (b.ref_count, b.owner, b.key, b.hits, b.children, b.priority, b.heap_stamp)
            for b in pool.blocks
        ]
        return blocks, pool.value_clock, len(manager.prefix_cache), manager.counters("t1")

    before = everything()
    hit = manager.match(request("t1", list(range(30)), Tenant("t1")))
    refusal = manager.admit(hit, 22)
    assert isinstance(refusal, QuotaExceeded) and refusal.quota_blocks == 4
    assert everything() == before


def test_lru_policy_evicts_in_release_order_across_owners_as_before() -> None:
    orders = {}
    for eviction in POLICIES:
        manager = manager_with(eviction, num_blocks=20)
        run(manager, "t1", prompt(0, 3), times=3)  # oldest, but hit twice
        run(manager, "t2", prompt(100, 4))
        run(manager, "t1", prompt(200, 2))
        run(manager, "t3", prompt(300, 3))
        # Each cached block's life and release time, before the pressure.
        cached_now = {
            b.block_id: (b.generation, b.last_released) for b in manager.pool.blocks if b.key
        }
        run(manager, "t4", prompt(400, 9))  # ten blocks, eight free: two evictions
        blocks = manager.pool.blocks
        evicted = {i for i, (life, _) in cached_now.items() if blocks[i].generation != life}
        orders[eviction] = evicted
        if eviction == "lru":  # the old rule: the globally least recently released go first
            oldest = sorted(cached_now, key=lambda block_id: cached_now[block_id][1])[:2]
            assert evicted == set(oldest)
    assert orders["value"] != orders["lru"]


def test_an_idle_block_that_gains_a_child_is_no_longer_taken_for_a_leaf() -> None:
    manager = manager_with("value", num_blocks=16)
    run(manager, "t1", prompt(100, 1), times=2)  # an idle leaf worth two hits
    # Two requests compute the same first block at once; the shorter one commits first.
    short = request("t1", prompt(0, 1), Tenant("t1"))
    long = request("t1", prompt(0, 3), Tenant("t1"))
    for each in (short, long):
        assert manager.admit(manager.match(each), len(each.prompt_token_ids)) is None
    manager.commit(short.request_id, 5)
    manager.free(short.request_id)
    [first] = [b for b in idle(manager, "t1") if b.token_bytes and b.hits == 0]
    assert first.children == 0
    # The long request's blocks now hang under the short one's block, idle all along.
    manager.commit(long.request_id, 13)
    assert first.children == 1 and first.ref_count == 0
    victim = manager.pool.victim("t1")
    assert victim is not None and victim is not first and victim.children == 0
    manager.pool.check_consistency()


def test_a_block_once_reused_ages_out_when_nobody_uses_it_any_more() -> None:
    survived = {}
    for eviction in POLICIES:
        manager = manager_with(eviction, num_blocks=8)
        popular = prompt(0, 1)
        run(manager, "t1", popular, times=4)
        one_offs = 0
        while cached(manager, "t1", popular) and one_offs < 1000:
            run(manager, "t1", prompt(1000 + 10 * one_offs, 1))
            one_offs += 1
        survived[eviction] = one_offs
    # GreedyDual: three hits buy the block time, and the rising clock ends it.
    assert survived["lru"] < survived["value"] < 1000


def test_stale_heap_entries_are_dropped_however_often_blocks_are_reused() -> None:
    manager = manager_with("value", num_blocks=16)
    for _ in range(300):
        run(manager, "t1", prompt(0, 3))  # each run files three blocks afresh
    heap = manager.pool._heaps["t1"]
    assert len(heap) <= 2 * len(idle(manager, "t1")) + 32
    manager.pool.check_consistency()


def test_switching_policy_reorders_the_idle_blocks_at_once() -> None:
    manager = manager_with("lru", num_blocks=16)
    run(manager, "t1", prompt(0, 2), times=3)
    run(manager, "t1", prompt(100, 2))
    assert manager.pool.victim("t1") is idle(manager, "t1")[0]  # the reused chain's tail
    manager.quotas.set_eviction("value")
    manager.pool.check_consistency()
    victim = manager.pool.victim("t1")
    assert victim is not None and victim.hits == 0 and victim.position == 1


def test_the_engine_evicts_by_its_configured_policy() -> None:
    assert engine_for("llama").pool.eviction == "value"
    assert engine_for("llama", eviction="lru").pool.eviction == "lru"
