"""The shared store: every worker of a model sees one index (budgets one worker learned
apply to another's puts), and two models under one prefix never mix."""

from __future__ import annotations

import os

import pytest
import redis
import torch

from engine.cache.scope import Tenant
from engine.cache.tier.backends import make_tier
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.redis_store import RedisStore
from engine.cache.tier.store import PutPlan, TierBudget
from tests.engine.cache.tier.conftest import (
    HASHER,
    ROOT,
    SPEC,
    blocks_of,
    new_id,
    random_kv,
    seal_key,
    value_of,
)

SIZE = 600


def test_budget_one_worker_wrote_bounds_another_workers_puts(
    redis_server: str, redis_prefix: str
) -> None:
    first = RedisStore(redis_server, ROOT, 100 * SIZE, redis_prefix)
    second = RedisStore(redis_server, ROOT, 100 * SIZE, redis_prefix)
    first.set_budget("t1", TierBudget(2 * SIZE))
    ids = [new_id() for _ in range(3)]
    for value, entry_id in enumerate(ids):
        assert isinstance(second.put(entry_id, "t1", value_of(SIZE), float(value)), PutPlan)
    assert first.contains(ids) == [False, True, True]
    assert first.usage()["t1"].entries == 2
    first.close()
    second.close()


def test_two_models_under_one_prefix_never_mix(redis_server: str, redis_prefix: str) -> None:
    other_root = HASHER.root("another-model", "", "bfloat16")
    first = RedisStore(redis_server, ROOT, 100 * SIZE, redis_prefix)
    other = RedisStore(redis_server, other_root, 100 * SIZE, redis_prefix)
    entry_id = new_id()
    first.put(entry_id, "t1", value_of(SIZE), 1.0)
    assert other.contains([entry_id]) == [False] and other.usage() == {}
    first.close()
    other.close()


def test_keys_name_no_block_key_and_sit_under_the_prefix(
    redis_server: str, redis_prefix: str
) -> None:
    store = RedisStore(redis_server, ROOT, 100 * SIZE, redis_prefix)
    entry_id = os.urandom(16)
    store.put(entry_id, "t1", value_of(SIZE), 1.0)
    client = redis.Redis.from_url(redis_server)
    keys = [key.decode() for key in client.scan_iter(match=f"{redis_prefix}:*")]
    assert keys and all(
        key.startswith(f"{redis_prefix}:tier:{{{ROOT.hex()[:32]}}}:") for key in keys
    )
    client.close()
    store.close()


def test_tier_made_from_settings_shares_one_store_between_workers(
    redis_server: str, redis_prefix: str
) -> None:
    def worker() -> KVTier:
        return make_tier(
            "redis",
            spec=SPEC,
            root=ROOT,
            capacity_bytes=1 << 20,
            redis_url=redis_server,
            key_prefix=redis_prefix,
        )

    key = seal_key()
    block = blocks_of(list(range(4)), Tenant("t1"), "t1")[0]
    first, second = worker(), worker()
    kv = random_kv(0)
    assert first.offload(block, key, kv, 1.0)
    first.flush()
    loaded = second.load([block], [key])[0]
    assert loaded is not None and torch.equal(loaded, kv)
    first.close()
    second.close()


@pytest.mark.timeout(20)
def test_drifted_entry_count_never_stalls_a_put(redis_server: str, redis_prefix: str) -> None:
    """An entry count above what the owner's set holds (say, a key lost by hand) must not
    make the rule ask for ever wider views."""
    store = RedisStore(redis_server, ROOT, 100 * SIZE, redis_prefix)
    store.set_budget("t1", TierBudget(2 * SIZE))
    first = new_id()
    store.put(first, "t1", value_of(SIZE), 1.0)
    store.put(new_id(), "t1", value_of(SIZE), 2.0)
    client = redis.Redis.from_url(redis_server)
    client.hincrby(f"{redis_prefix}:tier:{{{ROOT.hex()[:32]}}}:entries", "t1", 1000)
    client.close()
    plan = store.put(new_id(), "t1", value_of(SIZE), 3.0)
    assert isinstance(plan, PutPlan)
    assert [e.victim.entry_id for e in plan.evictions] == [first]
    store.close()
