"""bench.tier end to end on a small trace: two real workers sharing a real Redis tier, one
restarted midway, a real gateway routing to them."""

from __future__ import annotations

import redis

from bench.routing import Workloads
from bench.tier import QUARTERS, measure

# Two groups and two conversations: every quarter sends two gsp calls and one turn of each.
SIZES = Workloads(groups=2, per_group=4, system_words=120, conversations=2, turns=4, concurrency=2)
POOL_MIB = 6.0  # 768 tokens of the wide shape's KV: two whole conversations in flight fit


def test_the_tier_run_loads_blocks_back_and_fails_nothing(redis_server: str) -> None:
    # The wide shape: a block computes in about ten times what it takes to load, so the cost
    # rule loads whatever the tier holds (the tiny model's may not).
    result = measure(None, "wide", SIZES, ["cache_aware+tier"], redis_server, POOL_MIB)

    run = result["results"]["cache_aware+tier"]
    assert run["failures"] == 0, run["first_failures"]
    assert run["requests"] == SIZES.groups * SIZES.per_group + SIZES.conversations * SIZES.turns
    assert run["ttft_ms"]["streamed"] > 0 and run["ttft_ms"]["p50"] is not None
    assert len(run["cached_share_by_quarter"]) == QUARTERS
    assert run["restart"]["seconds"] > 0
    assert set(run["restart"]["restarted_worker"]) >= {"quarter_before", "quarter_after"}
    tier = run["tier_traffic"]
    assert tier["loaded_blocks"] > 0
    assert tier["loaded_kv_bytes"] == tier["loaded_blocks"] * 16 * result["kv_bytes_per_token"]
    assert tier["held_entries"] > 0 and tier["held_sealed_bytes"] > 0
    assert set(tier["cost_rule"]) == {"at_start", "at_end"}
    assert len(run["pool_evicted_blocks"]) == 2
    assert result["goals"]["restart_warm"]["met"] in (True, False)
    assert result["goals"]["tier_gain"]["met"] is None  # cache_aware alone did not run
    # The run's keys are gone from Redis.
    client = redis.Redis.from_url(redis_server)
    assert not list(client.scan_iter(match=f"{run['redis_key_prefix']}:*"))
    client.close()
