"""A deleted tenant's requests: those in flight end with `TenantDeleted` (the gateway's 403),
never a bare engine error (a 500); one still in the engine's inbox when the deletion runs, or
arriving after it, is refused before it holds a block, so nothing of the tenant is cached
again."""

from __future__ import annotations

import dataclasses

import pytest

from engine.engine import Engine
from engine.errors import TenantDeleted
from tests.engine.prompts import tokens
from tests.support.models import Collector, engine_for, make_request, run_one


def cached_blocks(engine: Engine, tenant: str) -> int:
    owner = engine.cache_stats().owners.get(tenant)
    return owner.cached_blocks if owner else 0


@pytest.mark.parametrize("steps_before", [0, 1, 3], ids=["waiting", "prefilling", "decoding"])
def test_a_deleted_tenants_request_in_flight_ends_typed(steps_before: int) -> None:
    engine = engine_for("llama", max_num_batched_tokens=32)
    doomed, neighbour = Collector(), Collector()
    engine.submit(make_request("doomed", tokens(1, 40), "t1", max_tokens=50), doomed)
    engine.submit(make_request("neighbour", tokens(2, 40), "t2", max_tokens=4), neighbour)
    for _ in range(steps_before):
        engine.step()

    engine.purge_tenant("t1")

    assert isinstance(doomed.error, TenantDeleted)
    assert cached_blocks(engine, "t1") == 0
    while engine.step():
        pass
    assert neighbour.error is None and neighbour.done  # the neighbour is served as before


def test_a_request_reaching_the_engine_after_its_tenants_deletion_is_refused_uncached() -> None:
    engine = engine_for("llama")
    run_one(engine, make_request("before", tokens(1, 40), "t1", max_tokens=1))
    engine.purge_tenant("t1")

    # It passed the gateway's key check before the deletion and sat in the inbox through it.
    late = Collector()
    engine.submit(make_request("late", tokens(1, 40), "t1", max_tokens=4), late)
    while engine.step():
        pass

    assert isinstance(late.error, TenantDeleted)
    assert late.deltas == []
    assert cached_blocks(engine, "t1") == 0
    assert engine.in_flight == 0


def test_every_choice_of_a_deleted_tenants_queued_request_is_refused() -> None:
    engine = engine_for("llama")
    engine.purge_tenant("t1")
    errors: list[Exception] = []
    request = dataclasses.replace(make_request("n3", tokens(1, 20), "t1", max_tokens=4), n=3)
    engine.submit(
        request, lambda item: errors.append(item) if isinstance(item, Exception) else None
    )
    while engine.step():
        pass
    assert len(errors) == 3 and all(isinstance(error, TenantDeleted) for error in errors)
    assert engine.in_flight == 0
