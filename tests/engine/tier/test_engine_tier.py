"""The engine with a second KV tier: blocks offloaded at commit are read back by a later
engine over the same tier (a restarted worker), verified and sealed per tenant."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from engine.cache.budget import TenantBudget
from engine.cache.cache_request import SealKeys
from engine.cache.tier.sealing import SealKey
from engine.config import TierConfig
from engine.engine import Engine
from engine.request import GenerationRequest
from engine.step_cost import StepCost
from tests.support.models import engine_for, make_request, run_one

# Computing a block costs far more than reading it back here, whatever the machine: the cost
# rule reads every block the tier holds.
SLOW_PREFILL = StepCost(fixed_ms=1.0, per_token_ms=50.0, per_context_ms=0.0)
PROMPT = list(range(1, 70))  # 4 full blocks of 16 before the last token
KEY_T1 = SealKey("t1-key", os.urandom(32))
KEY_T2 = SealKey("t2-key", os.urandom(32))


# As SLOW_PREFILL, but a block's prefill grows with its position (its attention reads every
# position before it), as on a real machine.
GROWING_PREFILL = StepCost(fixed_ms=1.0, per_token_ms=5.0, per_context_ms=1.0)


def tiered_engine(directory: Path, cost: StepCost = SLOW_PREFILL) -> Engine:
    tier = TierConfig("disk", 64 << 20, directory=directory, worker_name="w0")
    return engine_for("llama", step_cost=cost, kv_tier=tier)


def sealed(request: GenerationRequest, key: SealKey) -> GenerationRequest:
    return replace(request, seal_keys=SealKeys(key))


def close(engine: Engine) -> None:
    assert engine.kv_tier is not None
    engine.kv_tier.flush()
    engine.kv_tier.close()


def test_a_restarted_engine_reads_its_tenants_blocks_back_from_the_tier(tmp_path: Path) -> None:
    first = tiered_engine(tmp_path)
    cold = run_one(first, sealed(make_request("a", PROMPT, tenant="t1"), KEY_T1))
    assert cold.usage.cached_tokens == 0
    close(first)

    second = tiered_engine(tmp_path)  # nothing in its pool
    warm = run_one(second, sealed(make_request("b", PROMPT, tenant="t1"), KEY_T1))
    assert warm.usage.cached_tokens == 64
    assert warm.token_ids == cold.token_ids  # I1: the tier's KV is the computed KV
    assert warm.usage.cache is not None
    assert warm.usage.cache.cached["own.tier"] == 64
    assert warm.usage.cache.tier_loads == 4
    close(second)


def test_another_key_or_tenant_misses_in_the_tier(tmp_path: Path) -> None:
    first = tiered_engine(tmp_path)
    cold = run_one(first, sealed(make_request("a", PROMPT, tenant="t1"), KEY_T1))
    close(first)

    second = tiered_engine(tmp_path)
    # Same tenant and tokens, another data key (a shredded and re-made key): entry ids are
    # keyed by the data key, so the old entries are not even found.
    rekeyed = run_one(second, sealed(make_request("b", PROMPT, tenant="t1"), KEY_T2))
    # Another tenant: its scope makes other block keys, so nothing is even looked up.
    other = run_one(second, sealed(make_request("c", PROMPT, tenant="t2"), KEY_T2))
    assert rekeyed.usage.cached_tokens == 0
    assert other.usage.cached_tokens == 0
    assert rekeyed.token_ids == cold.token_ids == other.token_ids
    assert second.kv_tier is not None
    second.kv_tier.flush()
    t1 = second.kv_tier.stats().owners["t1"]
    assert (t1.counters.loads, t1.counters.missed) == (0, 0)
    # The blocks are held twice now, under each key's ids (the old ones age out).
    assert t1.entries == 8
    close(second)


def test_a_deleted_tenants_tier_entries_are_removed(tmp_path: Path) -> None:
    engine = tiered_engine(tmp_path)
    run_one(engine, sealed(make_request("a", PROMPT, tenant="t1"), KEY_T1))
    assert engine.kv_tier is not None
    engine.kv_tier.flush()
    assert engine.kv_tier.stats().owners["t1"].entries == 4
    engine._end_tenant("t1")
    engine.kv_tier.flush()
    stats = engine.kv_tier.stats().owners.get("t1")
    assert stats is None or stats.entries == 0
    close(engine)


def test_requests_without_keys_never_touch_the_tier(tmp_path: Path) -> None:
    engine = tiered_engine(tmp_path)
    run_one(engine, make_request("a", PROMPT, tenant="t1"))
    assert engine.kv_tier is not None
    engine.kv_tier.flush()
    assert "t1" not in engine.kv_tier.stats().owners or (
        engine.kv_tier.stats().owners["t1"].entries == 0
    )
    close(engine)


def test_cache_stats_show_each_owners_part_of_the_tier(tmp_path: Path) -> None:
    engine = tiered_engine(tmp_path)
    run_one(engine, sealed(make_request("a", PROMPT, tenant="t1"), KEY_T1))
    assert engine.kv_tier is not None
    engine.kv_tier.flush()
    deadline = time.monotonic() + 5
    while engine.cache_stats().owners["t1"].tier_entries < 4 and time.monotonic() < deadline:
        engine.step()  # the tier's usage is read in the background, about once a second
        time.sleep(0.05)
    stats = engine.cache_stats()
    owner = stats.owners["t1"]
    assert stats.tier_kind == "disk"
    assert owner.tier_entries == 4
    assert owner.tier_offloads == 4
    assert owner.tier_bytes >= 4 * engine.pool.spec.bytes_per_block
    assert owner.tier_quota_bytes > 0
    close(engine)


def test_a_full_tier_cuts_chains_from_their_tails(tmp_path: Path) -> None:
    """Offloads past the tenant's tier quota evict the least valuable blocks: a chain's tail
    (whose reuse saves only itself) before its head (without which no block after it can be
    read back), so the newest prompt comes back warm from its first block on."""
    first = tiered_engine(tmp_path, GROWING_PREFILL)
    assert first.kv_tier is not None
    budget = TenantBudget(256, tier_quota_bytes=6 * first.kv_tier.bytes_per_entry)
    prompts = [list(range(100 * n + 1, 100 * n + 70)) for n in range(1, 5)]  # 4 blocks each
    for n, prompt in enumerate(prompts):
        request = replace(make_request(f"p{n}", prompt, tenant="t1"), budget=budget)
        run_one(first, sealed(request, KEY_T1))
        first.kv_tier.flush()
    close(first)

    second = tiered_engine(tmp_path, GROWING_PREFILL)
    newest = replace(make_request("again", prompts[-1], tenant="t1"), budget=budget)
    warm = run_one(second, sealed(newest, KEY_T1))
    assert warm.usage.cached_tokens >= 32  # its head and the block after it, at least
    close(second)
