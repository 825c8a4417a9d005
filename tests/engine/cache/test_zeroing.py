"""I4: KV memory that leaves a scope is zeroed, in one batched operation, before reuse."""

from __future__ import annotations

from engine.cache.budget import TenantBudget
from engine.cache.scope import NO_CACHE, Tenant, User
from engine.cache.stats import snapshot
from tests.support.cache import blocks_are_zero, fill_blocks, make_manager, request, run_prompt


def admitted(manager, req):  # type: ignore[no-untyped-def]
    hit = manager.match(req)
    assert manager.admit(hit, len(req.prompt_token_ids) - hit.cached_tokens) is None
    return req


def test_blocks_freed_without_caching_are_zeroed_at_step_end() -> None:
    manager = make_manager()
    req = admitted(manager, request("t1", list(range(10)), NO_CACHE))
    block_ids = fill_blocks(manager, req.request_id)
    manager.free(req.request_id)
    assert not blocks_are_zero(manager, block_ids)  # not yet: zeroing is batched per step
    before = manager.pool.zero_operations
    assert manager.end_step() == len(block_ids)
    assert manager.pool.zero_operations == before + 1  # one tensor operation for all of them
    assert blocks_are_zero(manager, block_ids)


def test_evicted_blocks_are_zero_before_another_tenant_gets_them() -> None:
    manager = make_manager(num_blocks=4)
    secret = admitted(manager, request("t1", list(range(16)), User("t1", "alice")))
    manager.commit(secret.request_id, 16)
    block_ids = fill_blocks(manager, secret.request_id)
    manager.free(secret.request_id)
    manager.end_step()
    assert not blocks_are_zero(manager, block_ids)  # cached, still holding t1's KV
    # t2 needs the whole pool: every t1 block is evicted and handed to t2.
    other = admitted(manager, request("t2", list(range(50, 66)), User("t2", "bob")))
    assert sorted(manager.block_ids(other.request_id)) == sorted(block_ids)
    assert blocks_are_zero(manager, block_ids)
    assert snapshot(manager).owners["t1"].counters.evicted_blocks == 4


def test_purge_zeroes_all_of_a_tenants_cached_blocks_at_once() -> None:
    manager = make_manager()
    filled: list[int] = []
    for user in ("alice", "bob"):
        req = admitted(manager, request("t1", list(range(13)), User("t1", user)))
        manager.commit(req.request_id, 13)
        filled += fill_blocks(manager, req.request_id)
        manager.free(req.request_id)
    neighbour = admitted(manager, request("t2", list(range(13)), Tenant("t2")))
    manager.commit(neighbour.request_id, 13)
    kept = fill_blocks(manager, neighbour.request_id)
    manager.free(neighbour.request_id)
    manager.end_step()

    before = manager.pool.zero_operations
    assert manager.purge("t1") == 6
    assert manager.pool.zero_operations == before + 1
    assert blocks_are_zero(manager, filled)
    assert not blocks_are_zero(manager, kept)
    assert run_prompt(manager, request("t1", list(range(13)), User("t1", "alice"))) == 0
    assert run_prompt(manager, request("t2", list(range(13)), Tenant("t2"))) == 12


def test_purge_of_blocks_in_use_unhooks_them_and_zeroes_them_when_released() -> None:
    manager = make_manager()
    req = admitted(manager, request("t1", list(range(13)), Tenant("t1")))
    manager.commit(req.request_id, 13)
    block_ids = fill_blocks(manager, req.request_id)
    manager.purge("t1")
    assert len(manager.prefix_cache) == 0
    manager.free(req.request_id)
    manager.end_step()
    assert blocks_are_zero(manager, block_ids)


def test_shrinking_a_quota_evicts_and_zeroes_at_once() -> None:
    manager = make_manager()
    req = admitted(manager, request("t1", list(range(17)), Tenant("t1")))
    manager.commit(req.request_id, 17)
    block_ids = fill_blocks(manager, req.request_id)
    manager.free(req.request_id)
    manager.end_step()
    # Four full blocks were cached; the fifth (one token) was zeroed when the request ended.
    assert manager.set_budget("t1", TenantBudget(quota_blocks=2)) == 2
    assert sum(blocks_are_zero(manager, [block_id]) for block_id in block_ids) == 3
    assert snapshot(manager).owners["t1"].cached_blocks == 2
