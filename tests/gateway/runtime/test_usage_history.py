"""The usage history behind the admin console's charts: a bounded ring per owner, window
summaries that are exact differences of the running totals (a tenant's share of service among
them), and tenants that can be forgotten."""

from __future__ import annotations

import pytest

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.quotas import OwnerCounters
from engine.cache.stats import CacheStats, OwnerStats
from engine.metrics import TenantService
from gateway.runtime.usage_history import PUBLIC, UsageHistory, UsageSummary


def owner(
    cached_blocks: int = 0,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    own: int = 0,
    pressure: int = 0,
    purged: int = 0,
) -> OwnerStats:
    counters = OwnerCounters(prompt_tokens, cached_tokens, own, pressure, purged)
    return OwnerStats(
        active_blocks=1,
        cached_blocks=cached_blocks,
        reserved_blocks=2,
        quota_blocks=10,
        counters=counters,
    )


def stats(owners: dict[Owner, OwnerStats]) -> CacheStats:
    return CacheStats(
        num_blocks=64,
        free_blocks=0,
        cached_keys=0,
        blocks_zeroed=0,
        zero_operations=0,
        collisions=0,
        peak_active_blocks=0,
        owners=owners,
    )


def test_default_ring_holds_fifteen_minutes_of_two_second_samples() -> None:
    history = UsageHistory()
    assert (history.interval_s, history.retention_s, history.max_samples) == (2.0, 900.0, 450)


def test_ring_keeps_only_the_newest_samples() -> None:
    history = UsageHistory(interval_s=1.0, retention_s=5.0)
    for t in range(12):
        history.sample(stats({"t1": owner(cached_blocks=t)}), {}, now=float(t))
    window = history.window("t1", seconds=1000.0, now=11.0)
    assert [sample.t for sample in window.samples] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert [sample.cached_blocks for sample in window.samples] == [7, 8, 9, 10, 11]


def test_summary_is_the_growth_of_the_totals_since_just_before_the_window() -> None:
    history = UsageHistory(interval_s=2.0, retention_s=60.0)
    for step in range(6):  # t = 0, 2, ..., 10
        t = 2.0 * step
        for _ in range(step):
            history.count_request("t1", failed=step == 5)
        sample = owner(
            prompt_tokens=100 * step,
            cached_tokens=30 * step,
            own=step,
            pressure=2 * step,
            purged=7,
        )
        history.sample(stats({"t1": sample}), {}, now=t)

    window = history.window("t1", seconds=4.0, now=10.0)
    assert [sample.t for sample in window.samples] == [8.0, 10.0]
    # From the sample at t=6 (3 steps in, 0+1+2+3 = 6 requests) to t=10 (5 steps, 15).
    assert window.summary == UsageSummary(
        prompt_tokens=200,
        prefill_tokens_saved=60,
        hit_ratio=0.3,
        evicted_own_blocks=2,
        evicted_pressure_blocks=4,
        requests=9,
        errors=5,
    )
    latest = window.samples[-1]
    assert (latest.requests, latest.errors, latest.purged_blocks) == (15, 5, 7)
    assert (latest.active_blocks, latest.reserved_blocks, latest.quota_blocks) == (1, 2, 10)

    # A window reaching past the oldest sample runs from that sample.
    everything = history.window("t1", seconds=100.0, now=10.0)
    assert len(everything.samples) == 6
    assert everything.summary.prompt_tokens == 500 and everything.summary.requests == 15


def test_hit_ratio_is_zero_without_prompts_and_unknown_owners_get_an_empty_window() -> None:
    history = UsageHistory()
    for t in (0.0, 2.0):
        history.sample(stats({"t1": owner(cached_blocks=3)}), {}, now=t)
    assert history.window("t1", seconds=10.0, now=2.0).summary == UsageSummary()
    nobody = history.window("t9", seconds=10.0, now=2.0)
    assert (nobody.samples, nobody.summary) == ([], UsageSummary())


def test_public_budget_is_sampled_as_public_and_requests_without_blocks_count() -> None:
    history = UsageHistory()
    history.count_request("refused-tenant", failed=True)
    history.sample(stats({PUBLIC_OWNER: owner(cached_blocks=5)}), {}, now=1.0)
    assert sorted(history.owners()) == [PUBLIC, "refused-tenant"]
    assert history.window(PUBLIC, 10.0, now=1.0).samples[-1].cached_blocks == 5
    refused = history.window("refused-tenant", 10.0, now=1.0).samples[-1]
    assert (refused.requests, refused.errors, refused.cached_blocks) == (1, 1, 0)


def test_forget_drops_a_tenant_until_it_makes_a_request_again() -> None:
    history = UsageHistory()
    engine_stats = stats({"gone": owner(cached_blocks=1), "kept": owner(cached_blocks=2)})
    history.count_request("gone", failed=False)
    history.sample(engine_stats, {}, now=0.0)
    history.forget("gone")
    history.sample(engine_stats, {}, now=2.0)  # the engine still reports its counters
    assert history.owners() == ["kept"]
    assert history.window("gone", 10.0, now=2.0).samples == []
    history.count_request("gone", failed=False)
    history.sample(engine_stats, {}, now=4.0)
    assert history.window("gone", 10.0, now=4.0).samples[-1].requests == 1  # counted afresh


def test_an_owner_absent_for_a_whole_retention_is_dropped() -> None:
    history = UsageHistory(interval_s=1.0, retention_s=3.0)
    history.sample(stats({"t1": owner(), "t2": owner()}), {}, now=0.0)
    for t in (1.0, 2.0):
        history.sample(stats({"t2": owner()}), {}, now=t)
    assert sorted(history.owners()) == ["t1", "t2"]  # t1 gone for 2 s only
    history.sample(stats({"t2": owner()}), {}, now=3.0)
    assert history.owners() == ["t2"]


def served(**service: float) -> dict[str, TenantService]:
    """The engine's running service totals by tenant id."""
    return {tenant: TenantService(service=total) for tenant, total in service.items()}


def test_service_share_is_the_tenants_growth_over_every_tenants_in_the_window() -> None:
    history = UsageHistory()
    both = stats({"t1": owner(), "t2": owner(), PUBLIC_OWNER: owner()})
    for t, t1, t2 in ((0.0, 0, 0), (2.0, 100, 100), (4.0, 300, 200), (6.0, 600, 300)):
        history.sample(both, served(t1=t1, t2=t2), now=t)
    assert [s.service for s in history.window("t1", 100.0, now=6.0).samples] == [0, 100, 300, 600]
    # From the sample at t=2 to t=6: t1 was served 500, t2 200.
    t1, t2 = (history.window(name, 4.0, now=6.0).summary for name in ("t1", "t2"))
    assert (t1.service, t1.service_share) == (500.0, 500 / 700)
    assert (t2.service, t2.service_share) == (200.0, 200 / 700)
    assert history.window(PUBLIC, 4.0, now=6.0).summary.service_share == 0.0


def test_a_tenant_that_arrives_later_shares_only_what_was_served_since_it_could_be() -> None:
    history = UsageHistory()
    history.sample(stats({"t1": owner()}), served(t1=0), now=0.0)
    history.sample(stats({"t1": owner()}), served(t1=100), now=2.0)
    # t2's first sample: 50 served since t=2, while t1 got 100.
    history.sample(stats({"t1": owner(), "t2": owner()}), served(t1=200, t2=50), now=4.0)
    newcomer = history.window("t2", 100.0, now=4.0).summary
    assert (newcomer.service, newcomer.service_share) == (50.0, 50 / 150)
    assert history.window("t1", 100.0, now=4.0).summary.service_share == 200 / 250


def test_nothing_served_is_a_zero_share_and_shrinking_totals_never_exceed_the_whole() -> None:
    history = UsageHistory()
    for t in (0.0, 2.0):
        history.sample(stats({"t1": owner()}), served(t1=10.0, t2=90.0), now=t)
    assert history.window("t1", 1.0, now=2.0).summary == UsageSummary()
    # A worker that stopped answering takes its part of every total with it.
    history.sample(stats({"t1": owner()}), served(t1=20.0, t2=85.0), now=4.0)
    assert history.window("t1", 1.0, now=4.0).summary.service_share == 1.0
    history.sample(stats({"t1": owner()}), served(t1=25.0, t2=0.0), now=6.0)
    shrunk = history.window("t1", 1.0, now=6.0).summary
    assert (shrunk.service, shrunk.service_share) == (5.0, 0.0)


def test_a_ring_shorter_than_one_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        UsageHistory(interval_s=5.0, retention_s=1.0)
