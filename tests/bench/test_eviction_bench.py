"""`bench.eviction` on a short trace: its JSON's fields, no broken quota or reservation, and a
violation check that does see a broken one."""

from __future__ import annotations

from bench.eviction import (
    POLICIES,
    POOL_FRACTIONS,
    STATED_COST,
    VARIANTS,
    Replay,
    main,
    make_manager,
    make_trace,
)
from engine.cache.budget import TenantBudget


def test_eviction_bench_reports_both_policies_at_every_pool_size_without_violations() -> None:
    result = main(["--requests", "80", "--cost", "stated", "--quiet", "--json"])
    assert result["violations"] == 0
    assert set(result["request_shares"]) == {"single_turn", "chat", "one_off"}
    ideal = result["unbounded"]
    assert ideal["working_set_blocks"] > 0 and 0 < ideal["hit_ratio"] < 1
    assert ideal["prefill_tokens"] < ideal["prompt_tokens"]
    sizes = result["pool_sizes"]
    assert [entry["fraction"] for entry in sizes] == list(POOL_FRACTIONS)
    for entry in sizes:
        assert entry["num_blocks"] == round(entry["fraction"] * ideal["working_set_blocks"])
        ran = VARIANTS if entry["fraction"] <= 0.5 else POLICIES
        for variant in ran:
            run = entry[variant]
            assert run["violations"] == run["quota_violations"] == 0
            assert run["reservation_violations"] == 0
            # No pool serves more from cache than one that never evicts.
            assert run["prefill_tokens"] >= ideal["prefill_tokens"]
            assert run["prefill_tokens"] + run["cached_tokens"] <= ideal["prompt_tokens"]
        lru, value = entry["lru"]["prefill_tokens"], entry["value"]["prefill_tokens"]
        assert entry["prefill_token_reduction"] == round(1 - value / lru, 4)
    assert isinstance(result["meets_goal"], bool)


def test_the_violation_check_counts_a_broken_reservation_and_a_broken_quota() -> None:
    trace = make_trace(40, seed=0)
    manager = make_manager(400, "value", STATED_COST)
    run = Replay(manager, STATED_COST, concurrency=1)
    run.run(trace)
    assert run.quota_violations == run.reservation_violations == 0
    pool = manager.pool
    victim = max((f"tenant-{index}" for index in range(4)), key=pool.owned)
    other = next(item.request for item in trace if item.request.tenant_id != victim)
    manager.set_budget(victim, TenantBudget(quota_blocks=400, reserved_blocks=pool.owned(victim)))

    def purge_victim() -> None:  # another tenant's "allocation" that takes reserved blocks
        manager.purge(victim)

    run.checked(other, purge_victim)
    assert run.reservation_violations == 1
    manager.set_budget(other.tenant_id, TenantBudget(quota_blocks=pool.owned(other.tenant_id)))

    def take_past_quota() -> None:
        pool.take(other.tenant_id, 1)

    run.checked(other, take_past_quota)
    assert run.quota_violations == 1
