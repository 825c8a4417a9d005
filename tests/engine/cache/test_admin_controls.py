"""What an admin's actions do to the cache: a quota shrink, a purge's accounting, a dropped
public prefix, and evictions told apart as the owner's own or a neighbour's pressure."""

from __future__ import annotations

from engine.cache.block_hash import encode_token_ids
from engine.cache.budget import PUBLIC_OWNER, TenantBudget
from engine.cache.scope import Public, Tenant
from engine.cache.stats import snapshot
from engine.engine import Engine
from tests.engine.prompts import shared_prefix_requests, tokens
from tests.support.cache import blocks_are_zero, fill_blocks, make_manager, request, run_prompt
from tests.support.models import engine_for, make_request, run_all, run_one

BLOCK = 16  # engine_for's block size


def chunks(prompt: list[int]) -> list[bytes]:
    """The stored token bytes of each full block of `prompt`."""
    return [encode_token_ids(prompt[i : i + BLOCK]) for i in range(0, len(prompt), BLOCK)]


def cached_chunks(engine: Engine, owner: str) -> set[bytes]:
    return {block.token_bytes for block in engine.pool.idle_blocks(owner)}


def block_ids_in(engine: Engine, scope: object) -> list[int]:
    return [block.block_id for block in engine.pool.blocks if block.scope == scope]


def test_quota_shrink_evicts_only_that_tenants_lru_blocks_and_stats_show_it_at_once() -> None:
    engine = engine_for("llama")
    older, newer, neighbours = tokens(1, 64), tokens(2, 64), tokens(3, 64)
    # 64 prompt tokens and one generated token: four full blocks each stay cached.
    run_one(engine, make_request("older", older, "t1", max_tokens=1))
    run_one(engine, make_request("newer", newer, "t1", max_tokens=1))
    run_one(engine, make_request("other", neighbours, "t2", max_tokens=1))
    assert engine.cache_stats().owners["t1"].cached_blocks == 8

    assert engine.set_budget("t1", TenantBudget(quota_blocks=5)) == 3

    stats = engine.cache_stats()  # no step ran since: the shrink itself refreshed it
    t1, t2 = stats.owners["t1"], stats.owners["t2"]
    assert (t1.cached_blocks, t1.quota_blocks) == (5, 5)
    assert t1.counters.evicted_own_blocks == 3
    assert t1.counters.evicted_pressure_blocks == 0
    assert (t2.cached_blocks, t2.counters.evicted_blocks) == (4, 0)
    # The older chain lost its tail first; the newer one and the neighbour are whole.
    assert cached_chunks(engine, "t1") == set(chunks(newer)) | {chunks(older)[0]}
    assert cached_chunks(engine, "t2") == set(chunks(neighbours))


def test_purge_refreshes_stats_before_it_returns() -> None:
    engine = engine_for("llama")
    run_one(engine, make_request("r", tokens(1, 64), "t1", max_tokens=1))
    assert engine.purge_tenant("t1") == 4
    counted = engine.cache_stats().owners["t1"]
    assert (counted.cached_blocks, counted.counters.purged_blocks) == (0, 4)
    assert counted.counters.evicted_blocks == 0  # an admin's purge is not an eviction


def test_pool_pressure_counts_on_the_victim_as_pressure() -> None:
    manager = make_manager(num_blocks=8)
    run_prompt(manager, request("t1", list(range(17)), Tenant("t1")))  # 4 blocks cached
    run_prompt(manager, request("t2", list(range(100, 125)), Tenant("t2")))  # 7 new, 4 free
    victim, taker = snapshot(manager).owners["t1"], snapshot(manager).owners["t2"]
    assert victim.counters.evicted_pressure_blocks == 3
    assert victim.counters.evicted_own_blocks == 0
    assert taker.counters.evicted_blocks == 0
    assert snapshot(manager).evicted_blocks == 3


def test_making_room_for_oneself_counts_as_own_eviction() -> None:
    manager = make_manager(num_blocks=32)
    manager.set_budget("t1", TenantBudget(quota_blocks=6))
    run_prompt(manager, request("t1", list(range(17)), Tenant("t1")))  # 4 blocks cached
    run_prompt(manager, request("t1", list(range(100, 109)), Tenant("t1")))  # 3 more: over
    counters = snapshot(manager).owners["t1"].counters
    assert (counters.evicted_own_blocks, counters.evicted_pressure_blocks) == (1, 0)

    # Within its quota, but the pool is short: t1's own block is the global LRU victim.
    full = make_manager(num_blocks=8)
    full.quotas.set_eviction("lru")  # the global LRU victim, as the comment below says
    run_prompt(full, request("t1", list(range(17)), Tenant("t1")))  # 4 cached, oldest
    run_prompt(full, request("t2", list(range(50, 59)), Tenant("t2")))  # 2 cached
    run_prompt(full, request("t1", list(range(100, 109)), Tenant("t1")))  # 3 new, 2 free
    counters = snapshot(full).owners["t1"].counters
    assert (counters.evicted_own_blocks, counters.evicted_pressure_blocks) == (1, 0)
    assert snapshot(full).owners["t2"].counters.evicted_blocks == 0


def test_dropping_a_public_prefix_drops_exactly_its_blocks_and_zeroes_them() -> None:
    engine = engine_for("llama")
    prefix = tokens(5, 50)  # three full blocks; the fourth is shared with private tokens
    [in_a] = shared_prefix_requests(prefix, "ns-a", ["t1"], 1, 1, "a")
    [in_b] = shared_prefix_requests(prefix, "ns-b", ["t2"], 1, 1, "b")
    private = make_request("private", prefix, "t1", max_tokens=1, scope=Tenant("t1"))
    run_all(engine, [in_a, in_b, private])
    dropped_ids = block_ids_in(engine, Public("ns-a"))
    kept_ids = block_ids_in(engine, Public("ns-b")) + block_ids_in(engine, Tenant("t1"))
    assert len(dropped_ids) == 3 and len(kept_ids) == 6
    assert not blocks_are_zero(engine.cache, dropped_ids)

    assert engine.drop_public_prefix("ns-a", prefix) == 3

    public = engine.cache_stats().owners[PUBLIC_OWNER]
    assert (public.cached_blocks, public.counters.purged_blocks) == (3, 3)
    assert public.counters.evicted_blocks == 0
    assert blocks_are_zero(engine.cache, dropped_ids)
    assert not any(blocks_are_zero(engine.cache, [block_id]) for block_id in kept_ids)
    [again_a] = shared_prefix_requests(prefix, "ns-a", ["t1"], 1, 1, "again-a")
    [again_b] = shared_prefix_requests(prefix, "ns-b", ["t2"], 1, 1, "again-b")
    again_private = make_request("again", prefix, "t1", max_tokens=1, scope=Tenant("t1"))
    hits = [c.usage.cached_tokens for c in run_all(engine, [again_a, again_b, again_private])]
    assert hits == [0, 64, 48]  # ns-b's repeat hits its private fourth block too


def test_a_dropped_public_prefix_in_use_stops_matching_and_is_zeroed_when_released() -> None:
    manager = make_manager()
    prefix = list(range(12))  # three blocks of four
    running = request("t1", prefix, Public("ns"))
    hit = manager.match(running)
    assert manager.admit(hit, len(prefix)) is None
    manager.commit(running.request_id, len(prefix))
    block_ids = fill_blocks(manager, running.request_id)

    assert manager.drop_public("ns", prefix) == 3

    assert manager.match(request("t2", [*prefix, 99], Public("ns"))).cached_tokens == 0
    assert not blocks_are_zero(manager, block_ids)  # still in use
    manager.free(running.request_id)
    manager.end_step()
    assert blocks_are_zero(manager, block_ids)
    assert manager.drop_public("ns", prefix) == 0
    assert manager.drop_public("ns", prefix[:3]) == 0  # not one full block
