"""`queue_depth` and `cache_stats` (the queue-depth and cache metrics) tell of the requests in
flight now, also after the last one ended in a step that found nothing left to run."""

from __future__ import annotations

import asyncio
import time

from engine.cache.stats import CacheStats
from engine.engine import Engine
from engine.errors import EngineError
from engine.scheduler import SchedulerOutput
from engine.step_cost import StepCost
from tests.engine.prompts import tokens
from tests.support.models import Collector, engine_for, make_request

SETTLE_S = 10.0  # far longer than a step of the tiny model


def active_blocks(stats: CacheStats) -> int:
    return sum(owner.active_blocks for owner in stats.owners.values())


def wait_for_empty_queue(engine: Engine) -> tuple[int, int]:
    """The engine thread's queue depth once it reads (0, 0), or as it stands after SETTLE_S
    (call it once the engine has reported a request: it starts out at (0, 0))."""
    deadline = time.monotonic() + SETTLE_S
    while engine.queue_depth() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.queue_depth()


def test_cancelling_the_last_requests_reports_an_empty_queue_and_no_active_blocks() -> None:
    engine = engine_for("llama", max_num_seqs=1)
    engine.submit(make_request("running", tokens(6, 50), max_tokens=100), Collector())
    engine.submit(make_request("waiting", tokens(7, 50), max_tokens=100), Collector())
    for _ in range(3):
        assert engine.step()
    assert engine.queue_depth() == (1, 1)
    assert active_blocks(engine.cache_stats()) > 0
    engine.cancel("running")
    engine.cancel("waiting")
    assert engine.step() is False  # the cancels leave nothing to run
    assert engine.queue_depth() == (0, 0)
    assert active_blocks(engine.cache_stats()) == 0


def test_a_streaming_client_that_goes_away_leaves_an_idle_engine_reporting_zero() -> None:
    engine = engine_for("llama").start()
    try:

        async def read_one_delta_then_leave() -> None:
            stream = engine.generate(make_request("gone", tokens(8, 40), max_tokens=500))
            await anext(stream)
            deadline = time.monotonic() + SETTLE_S
            while engine.queue_depth() != (0, 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the step that streamed the delta records it next
            assert engine.queue_depth() == (0, 1)
            await stream.aclose()  # what the gateway does when the client disconnects

        asyncio.run(read_one_delta_then_leave())
        assert wait_for_empty_queue(engine) == (0, 0)
        assert active_blocks(engine.cache_stats()) == 0
    finally:
        engine.stop(SETTLE_S)


def test_a_step_that_fails_everyone_reports_an_empty_queue() -> None:
    engine = engine_for("llama")
    schedule = engine.scheduler.schedule
    steps = 0

    def failing_on_the_third_step(
        threads: int, cost: StepCost | None, target_ms: float | None
    ) -> SchedulerOutput:  # a bug outside any one request
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("injected")
        return schedule(threads, cost, target_ms)

    engine.scheduler.schedule = failing_on_the_third_step  # type: ignore[method-assign]
    collector = Collector()
    engine.start()
    try:
        engine.submit(make_request("doomed", tokens(9, 40), max_tokens=500), collector)
        deadline = time.monotonic() + SETTLE_S
        while collector.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(collector.error, EngineError)
        assert steps == 3
        assert wait_for_empty_queue(engine) == (0, 0)
        assert active_blocks(engine.cache_stats()) == 0
    finally:
        engine.stop(SETTLE_S)
