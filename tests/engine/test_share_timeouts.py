"""Whose limit a waiting request timed out on: a tenant flooding past what its neighbours'
reservations leave it waits on its own limit (`CacheQuotaTimeout`, a 429), while one within
that share, waiting on a pool that others' running work fills, waits on a crowded pool
(`PoolTimeout`, a 503)."""

from __future__ import annotations

from engine.cache.budget import TenantBudget
from engine.engine import Engine
from engine.errors import CacheQuotaTimeout, PoolTimeout
from tests.engine.prompts import tokens
from tests.support.models import Collector, engine_for, make_request, run_one

BLOCK = 16  # engine_for's block size
POOL_BLOCKS = 16
NEIGHBOUR_BLOCKS = 8


def flooded_engine() -> tuple[Engine, list[float]]:
    """A 16-block pool on a scripted clock that times waiting requests out after 5 s."""
    engine = engine_for("llama", num_blocks=POOL_BLOCKS, queue_timeout_s=5.0)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    return engine, now


def flood(engine: Engine, now: list[float]) -> tuple[Collector, Collector]:
    """Tenant t1 runs a 4-block request and queues a 5-block one beside it, then waits past
    the queue timeout; returns (running, waiting)."""
    running, waiting = Collector(), Collector()
    engine.submit(make_request("running", tokens(1, 60), "t1", max_tokens=30), running)
    engine.submit(make_request("waiting", tokens(2, 80), "t1", max_tokens=4), waiting)
    engine.step()
    assert waiting.error is None  # waiting, not failed
    now[0] = 6.0
    engine.step()
    assert running.error is None
    return running, waiting


def test_flooding_past_a_neighbours_held_reservation_times_out_on_the_tenants_own_limit() -> None:
    engine, now = flooded_engine()
    engine.set_budget("t2", TenantBudget(POOL_BLOCKS, reserved_blocks=NEIGHBOUR_BLOCKS))
    # t2's eight cached blocks are idle but reserved: t1 may use the other eight only.
    run_one(
        engine,
        make_request("neighbour", tokens(3, NEIGHBOUR_BLOCKS * BLOCK + 1), "t2", max_tokens=1),
    )
    assert engine.cache_stats().owners["t2"].cached_blocks == NEIGHBOUR_BLOCKS

    _, waiting = flood(engine, now)

    assert isinstance(waiting.error, CacheQuotaTimeout)
    assert "share" in str(waiting.error) and "t1" not in str(waiting.error)
    assert engine.cache_stats().owners["t2"].cached_blocks == NEIGHBOUR_BLOCKS


def test_a_pool_crowded_by_a_neighbours_running_work_still_times_out_as_the_pool() -> None:
    engine, now = flooded_engine()
    # The same eight blocks of t2's, in use by a running request rather than reserved.
    neighbour = Collector()
    prompt = tokens(3, NEIGHBOUR_BLOCKS * BLOCK - 8)
    engine.submit(make_request("neighbour", prompt, "t2", max_tokens=100), neighbour)
    engine.step()

    _, waiting = flood(engine, now)

    assert isinstance(waiting.error, PoolTimeout)
    assert neighbour.error is None
