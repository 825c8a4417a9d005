"""I5 by example: quotas, reservations, LRU order and typed, side-effect-free refusals."""

from __future__ import annotations

import pytest

from engine.cache.budget import (
    PUBLIC_OWNER,
    PoolExhausted,
    QuotaExceeded,
    ShareExceeded,
    TenantBudget,
)
from engine.cache.cache_request import CacheRequest
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.scope import Public, Segment, Tenant
from engine.cache.stats import snapshot
from tests.support.cache import make_manager, request, run_prompt


def cache_blocks(manager: KVCacheManager, tenant: str, first_token: int, blocks: int) -> None:
    """Leave `blocks` idle cached blocks owned by `tenant` (plus one partial, freed)."""
    tokens = list(range(first_token, first_token + 4 * blocks + 1))
    run_prompt(manager, request(tenant, tokens, Tenant(tenant)))


def cached_blocks(manager: KVCacheManager, owner: str) -> int:
    return snapshot(manager).owners[owner].cached_blocks


def everything(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.pool
    return (
        snapshot(manager),
        len(manager.prefix_cache),
        [(b.ref_count, b.owner, b.key, b.last_released) for b in pool.blocks],
    )


def test_tenant_over_quota_evicts_its_own_lru_blocks_first() -> None:
    manager = make_manager(num_blocks=32)
    manager.set_budget("t1", TenantBudget(quota_blocks=7))
    cache_blocks(manager, "t2", 1000, 4)  # older than anything of t1's
    cache_blocks(manager, "t1", 0, 3)  # 4 blocks while running, 3 cached after
    cache_blocks(manager, "t1", 100, 3)
    assert cached_blocks(manager, "t1") == 6
    cache_blocks(manager, "t1", 200, 2)  # 6 + 3 > 7: two of its own oldest blocks go
    assert cached_blocks(manager, "t2") == 4
    assert cached_blocks(manager, "t1") == 6
    # The newer chain is whole; the oldest lost its tail before its head.
    assert run_prompt(manager, request("t1", list(range(100, 113)), Tenant("t1"))) == 12
    assert run_prompt(manager, request("t1", list(range(0, 13)), Tenant("t1"))) == 4


def test_full_pool_evicts_global_lru_above_reservations_only() -> None:
    manager = make_manager(num_blocks=12)
    manager.quotas.set_eviction("lru")  # by value, see test_eviction_policy.py
    manager.set_budget("t1", TenantBudget(quota_blocks=12, reserved_blocks=4))
    cache_blocks(manager, "t1", 0, 4)  # oldest, but reserved
    cache_blocks(manager, "t2", 100, 4)
    cache_blocks(manager, "t3", 200, 3)
    cache_blocks(manager, "t4", 300, 3)  # pool: 4 + 4 + 3 + 1 free... needs eviction
    assert cached_blocks(manager, "t1") == 4
    assert cached_blocks(manager, "t2") == 1  # global LRU among unreserved: t2 went first
    assert cached_blocks(manager, "t4") == 3


def test_tail_of_a_chain_is_evicted_before_its_head() -> None:
    manager = make_manager(num_blocks=5)
    cache_blocks(manager, "t1", 0, 4)
    cache_blocks(manager, "t2", 100, 1)  # two blocks: the free one and one eviction
    assert run_prompt(manager, request("t1", list(range(0, 17)), Tenant("t1"))) == 12


def test_quota_refusal_is_typed_and_changes_nothing() -> None:
    manager = make_manager(num_blocks=16)
    manager.set_budget("t1", TenantBudget(quota_blocks=4))
    cache_blocks(manager, "t1", 0, 2)
    before = everything(manager)
    hit = manager.match(request("t1", list(range(0, 30)), Tenant("t1")))
    assert hit.cached_tokens == 8
    refusal = manager.admit(hit, 22)
    assert isinstance(refusal, QuotaExceeded)
    assert refusal.owner == "t1" and refusal.quota_blocks == 4
    assert "quota exceeded for tenant 't1'" in str(refusal)
    assert everything(manager) == before


def test_pool_refusal_is_typed_and_never_touches_reserved_blocks() -> None:
    manager = make_manager(num_blocks=8)
    manager.set_budget("t1", TenantBudget(quota_blocks=8, reserved_blocks=6))
    cache_blocks(manager, "t1", 0, 6)
    run_prompt(manager, request("t3", list(range(200, 203)), Tenant("t3")), free=False)
    before = everything(manager)
    # Two blocks are t2's share beside t1's reservation, but t3 holds one of them: crowded.
    refusal = manager.admit(manager.match(request("t2", list(range(100, 105)), Tenant("t2"))), 5)
    assert isinstance(refusal, PoolExhausted)
    assert refusal.needed_blocks == 2 and refusal.available_blocks == 1
    assert everything(manager) == before


def test_tenant_past_its_share_beside_a_neighbours_reservation_is_refused_as_its_own() -> None:
    manager = make_manager(num_blocks=8)
    manager.set_budget("t1", TenantBudget(quota_blocks=8, reserved_blocks=6))
    cache_blocks(manager, "t1", 0, 6)
    before = everything(manager)
    # Four blocks, within t2's quota (the pool), but t1's reservation leaves t2 only two.
    refusal = manager.admit(manager.match(request("t2", list(range(100, 113)), Tenant("t2"))), 13)
    assert refusal == ShareExceeded("t2", needed_blocks=4, share_blocks=2, active_blocks=0)
    assert "share exceeded for tenant 't2'" in str(refusal)
    assert everything(manager) == before


def test_an_unused_reservation_does_not_shrink_a_neighbours_share() -> None:
    manager = make_manager(num_blocks=8)
    manager.set_budget("t1", TenantBudget(quota_blocks=8, reserved_blocks=6))  # holds nothing
    run_prompt(manager, request("t3", list(range(200, 225)), Tenant("t3")), free=False)  # 7
    refusal = manager.admit(manager.match(request("t2", list(range(100, 109)), Tenant("t2"))), 9)
    # t3's active blocks crowd the pool; t1's empty reservation is no limit on t2's three.
    assert isinstance(refusal, PoolExhausted)


def test_reservations_cannot_exceed_the_pool() -> None:
    manager = make_manager(num_blocks=8)
    manager.set_budget("t1", TenantBudget(quota_blocks=8, reserved_blocks=6))
    with pytest.raises(ValueError, match="reservations"):
        manager.set_budget("t2", TenantBudget(quota_blocks=8, reserved_blocks=3))
    with pytest.raises(ValueError):
        TenantBudget(quota_blocks=2, reserved_blocks=3)
    with pytest.raises(ValueError):
        TenantBudget(quota_blocks=-1)


def test_shrunk_quota_below_active_blocks_refuses_growth_and_sheds_on_release() -> None:
    manager = make_manager(num_blocks=16)
    req = request("t1", list(range(17)), Tenant("t1"))
    assert manager.admit(manager.match(req), 17) is None
    manager.commit(req.request_id, 17)
    manager.set_budget("t1", TenantBudget(quota_blocks=2))
    assert isinstance(manager.allocate(req.request_id, 21), QuotaExceeded)
    manager.free(req.request_id)
    assert cached_blocks(manager, "t1") == 2


def test_public_blocks_are_charged_to_the_public_budget() -> None:
    manager = make_manager(num_blocks=16, public_budget=TenantBudget(quota_blocks=2))
    segments = [Segment(0, 8, Public("ns")), Segment(8, 13, Tenant("t1"))]
    req = CacheRequest("r1", "t1", list(range(13)), segments, Tenant("t1"))
    run_prompt(manager, req)
    stats = snapshot(manager)
    assert stats.owners[PUBLIC_OWNER].cached_blocks == 2
    assert stats.owners["t1"].cached_blocks == 1
    # A third public block does not fit the public budget: refused, typed.
    bigger = CacheRequest(
        "r2", "t2", list(range(20)), [Segment(0, 12, Public("ns")), Segment(12, 20, Tenant("t2"))]
    )
    hit = manager.match(bigger)
    refusal = manager.admit(hit, 20 - hit.cached_tokens)
    assert isinstance(refusal, QuotaExceeded) and refusal.owner is PUBLIC_OWNER


def test_budget_carried_by_a_request_applies_immediately() -> None:
    manager = make_manager(num_blocks=16)
    cache_blocks(manager, "t1", 0, 3)
    small = TenantBudget(quota_blocks=2)
    run_prompt(manager, request("t1", [9], Tenant("t1"), budget=small))
    assert manager.budget("t1") == small
    assert cached_blocks(manager, "t1") <= 2


def test_reservations_carried_by_requests_are_cut_to_fit_the_pool() -> None:
    manager = make_manager(num_blocks=8)
    manager.set_budget("t1", TenantBudget(quota_blocks=8, reserved_blocks=6))
    greedy = TenantBudget(quota_blocks=8, reserved_blocks=5)
    run_prompt(manager, request("t2", list(range(9)), Tenant("t2"), budget=greedy))
    assert manager.budget("t2") == TenantBudget(quota_blocks=8, reserved_blocks=2)
