"""`bench.soak`, short: load, a noisy neighbour and a disconnect storm leave no block, sequence
or concurrency slot behind, lose no audit event, and answer no 5xx.

The same functions `make soak` runs, for seconds instead of minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak, soak_checks, soak_neighbour
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import load_model


def test_the_idle_check_sees_a_held_block_and_a_dirty_free_block(tiny_chat_dir: Path) -> None:
    engine = Engine(load_model(tiny_chat_dir), EngineConfig(num_blocks=8))
    clean = soak_checks.engine_report(engine)
    assert clean["active_blocks"] == 0 and clean["nonzero_free_blocks"] == 0
    assert clean["free_blocks"] == 8 and clean["consistency_error"] is None
    engine.pool.take("tenant", 1)  # a block nobody gives back
    engine.pool.kv[:, :, 5].fill_(1.0)  # a free block that was never zeroed
    report = soak_checks.engine_report(engine)
    assert report["active_blocks"] == 1
    assert report["nonzero_free_blocks"] == 1
    report.update(slots_in_use={"t": 1}, fresh_request_status={"t": 429, "u": 429})
    report.update(window_full=["u"])  # u used its request window: served once it has passed
    assert soak_checks.idle_problems(report) == [
        "active_blocks: 1",
        "nonzero_free_blocks: 1",
        "t: 1 slots not back",
        "t: fresh request answered 429",
    ]


@pytest.mark.slow
def test_load_leaves_nothing_behind_and_answers_no_5xx(tiny_chat_dir: Path) -> None:
    result = soak.load(tiny_chat_dir, seconds=10, clients=6)
    assert result["problems"] == [], result["problems"]
    assert result["statuses"] == {"200": result["requests"]}
    assert result["left_after_first_chunk"] > 0  # the disconnect path ran
    assert 0 < result["streams"] < result["requests"]  # streams and whole answers both ran
    for tenant, stats in result["tenants"].items():
        assert stats["ttft"]["samples"] > 0, tenant
        assert stats["cached_tokens"] > 0, tenant  # the public prompt and earlier turns
    idle = result["idle"]
    assert idle["consistency_error"] is None
    assert idle["active_blocks"] == idle["in_flight_requests"] == idle["cache_sequences"] == 0
    assert idle["waiting"] == idle["running"] == 0
    assert idle["nonzero_free_blocks"] == 0
    assert set(idle["slots_in_use"].values()) == {0}
    assert set(idle["fresh_request_status"].values()) == {200}


@pytest.mark.slow
def test_a_flooding_neighbour_neither_evicts_a_reservation_nor_stalls_a_trickle(
    tiny_chat_dir: Path,
) -> None:
    result = soak.neighbour(tiny_chat_dir, seconds=6)
    assert result["problems"] == [], result["problems"]
    # The flood went over its request rate (429), its cache quota (400 for a prompt that can
    # never fit, 429 for one that waited too long) and the pool: some owner lost blocks by
    # pressure, so the reservation was what kept steady's.
    assert {"rate_limit_exceeded", "cache_quota_too_small"} <= set(result["flood"]["errors"])
    assert sum(result["pressure_evictions"].values()) > 0
    assert result["steady_cache"]["evicted_pressure_blocks"] == 0
    assert result["steady_cache"]["evicted_own_blocks"] > 0  # it did fill its reservation
    for phase in ("steady_alone", "steady_during_flood"):
        assert set(result[phase]["statuses"]) == {"200"}, result[phase]
    # Six seconds give tens of samples: the bound is on the median (a p99 would be the
    # maximum, and one stall of a busy machine moves a p90).
    assert result["bounded_percentile"] == "p50"
    assert result["ttft_ratio"] <= soak_neighbour.SHORT_RUN_BOUND, result
    # The flood's only 5xx is the documented 503 for a pool exhausted (`problems` holds others).
    assert result["flood"]["statuses"].get("503", 0) == result["flood"]["pool_exhausted_503"]


@pytest.mark.slow
def test_a_disconnect_storm_leaves_nothing_behind_and_one_audit_event_each(
    tiny_chat_dir: Path,
) -> None:
    result = soak.storm(tiny_chat_dir, clients=200)
    assert result["problems"] == [], result["problems"]
    assert result["left_after_first_chunk"] > 0 and result["left_during_prefill"] > 0
    audit = result["audit"]
    assert audit["events"] == 200 and audit["missing"] == audit["duplicated"] == 0
    assert set(audit["outcomes"]) <= {"cancelled", "success"}
    assert not any(status.startswith("5") for status in audit["statuses"])
    idle = result["idle"]
    assert idle["active_blocks"] == idle["in_flight_requests"] == idle["cache_sequences"] == 0
    assert idle["nonzero_free_blocks"] == 0 and idle["consistency_error"] is None
    assert idle["slots_in_use"] == {"storm": 0}
    assert idle["fresh_request_status"] == {"storm": 200}
