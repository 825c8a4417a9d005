"""I13: service counted per tenant over time, and short steps while another tenant waits on them.

The engine runs a tiny model, but time is scripted: a cost model given in the config (so steps
are predicted the same on every machine) and a clock that advances by each step's predicted
time. Nothing here reads the wall clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.request import GenerationDelta
from engine.scheduler import MIN_CAPPED_PREFILL_TOKENS, SchedulerOutput
from engine.step_cost import StepCost
from tests.support.models import Collector, engine_for, make_request

# Two ms a step, a twentieth of a ms a token: the default target (four decode steps) is 8.2 ms,
# and 124 prompt tokens fit in a step of their own within it.
COST = StepCost(fixed_ms=2.0, per_token_ms=0.05, per_context_ms=0.0)
TARGET_MS = COST.default_target_ms()
BUDGET = 128


class ScriptedTime:
    """Steps an engine by hand on a clock that advances by each step's predicted time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0
        self.outputs: list[SchedulerOutput] = []
        engine.scheduler.clock = lambda: self.now
        schedule = engine.scheduler.schedule

        def recording(
            threads: int, cost: StepCost | None, target_ms: float | None
        ) -> SchedulerOutput:
            output = schedule(threads, cost, target_ms)
            self.outputs.append(output)
            return output

        engine.scheduler.schedule = recording  # type: ignore[method-assign]

    def step(self) -> SchedulerOutput:
        assert self.engine.step()
        output = self.outputs[-1]
        self.now += output.predicted_ms / 1000.0
        return output

    def tokens(self, output: SchedulerOutput, tenant: str) -> int:
        return sum(c.num_tokens for c in output.chunks if c.sequence.request.tenant_id == tenant)


class TimedCollector(Collector):
    """A collector that notes the scripted time at the end of the step each token came in."""

    def __init__(self, time: ScriptedTime) -> None:
        super().__init__()
        self.time = time
        self.steps: list[int] = []

    def __call__(self, item: GenerationDelta | Exception) -> None:
        super().__call__(item)
        if isinstance(item, GenerationDelta):
            self.steps.extend([len(self.time.outputs) - 1] * len(item.token_ids))


def flood(engine: Engine, tenant: str, count: int, length: int, weight: float = 1.0) -> None:
    for i in range(count):
        request = make_request(f"{tenant}-{i}", [3 + i] * length, tenant=tenant, max_tokens=1)
        engine.submit(dataclasses.replace(request, weight=weight), Collector())


def shares(engine: Engine, tenants: Iterable[str]) -> dict[str, float]:
    service = {t: engine.service_stats()[t].service for t in tenants}
    total = sum(service.values())
    return {t: value / total for t, value in service.items()}


def test_two_flooding_tenants_of_equal_weight_stay_within_one_step_of_each_other() -> None:
    engine = engine_for("llama", max_num_batched_tokens=BUDGET, num_blocks=512)
    time = ScriptedTime(engine)
    flood(engine, "a", 6, 300)
    time.step()  # "a" alone for a step: "b" comes in behind
    flood(engine, "b", 6, 300)
    fair = engine.scheduler.fair
    for _ in range(20):
        output = time.step()
        assert sum(chunk.num_tokens for chunk in output.chunks) == BUDGET
        # Both held back every step: one step's service at most between them (I13).
        assert abs(fair.counter("a") - fair.counter("b")) <= BUDGET
    service = engine.service_stats()
    a = service["a"].service - BUDGET  # "a"'s step alone
    assert abs(a / (a + service["b"].service) - 0.5) <= 0.05


def test_weights_two_to_one_give_two_thirds_of_the_service() -> None:
    engine = engine_for("llama", max_num_batched_tokens=BUDGET, num_blocks=512)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 6, 300, weight=2.0)
    flood(engine, "light", 6, 300, weight=1.0)
    for _ in range(20):
        time.step()
    assert abs(shares(engine, ["heavy", "light"])["heavy"] - 2 / 3) <= 0.05


def test_a_tenant_back_from_idle_does_not_bank_credit() -> None:
    engine = engine_for("llama", max_num_batched_tokens=BUDGET, num_blocks=512)
    time = ScriptedTime(engine)
    flood(engine, "a", 8, 300)
    for _ in range(10):
        time.step()  # "a" alone: ten steps of service that "b" never asked for
    flood(engine, "b", 6, 300)
    before = engine.service_stats()["a"].service
    for _ in range(10):
        time.step()
    a = engine.service_stats()["a"].service - before
    b = engine.service_stats()["b"].service
    # "b" starts level with "a", not ten steps behind: the steps are shared from the first.
    assert abs(b / (a + b) - 0.5) <= 0.05


def test_a_light_tenant_is_never_more_than_one_step_of_credit_behind() -> None:
    engine = engine_for("llama", max_num_batched_tokens=BUDGET, num_blocks=512)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 8, 300)
    chat = make_request("chat", [9] * 20, tenant="light", max_tokens=40)
    engine.submit(chat, Collector())
    fair = engine.scheduler.fair
    for _ in range(15):
        time.step()  # "light" decodes a token a step; "heavy" takes the rest
        assert fair.counter("heavy") - fair.counter("light") <= BUDGET
    # When "light" starts to flood, it is ahead by at most one step's budget.
    flood(engine, "light", 6, 300)
    before = {t: engine.service_stats()[t].service for t in ("heavy", "light")}
    for _ in range(10):
        time.step()
    gained = {t: engine.service_stats()[t].service - before[t] for t in before}
    assert gained["light"] - gained["heavy"] <= 2 * BUDGET


def test_a_light_tenants_tokens_arrive_one_target_step_apart_while_another_floods() -> None:
    engine = engine_for("llama", max_num_batched_tokens=512, num_blocks=512, step_cost=COST)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 4, 1000)
    alone = time.step()
    assert not alone.capped and sum(c.num_tokens for c in alone.chunks) == 512  # all of it
    chat = TimedCollector(time)
    submitted_at = len(time.outputs)
    engine.submit(make_request("chat", [9] * 20, tenant="light", max_tokens=12), chat)
    while not chat.done:
        output = time.step()
        assert output.capped and output.predicted_ms <= TARGET_MS
        assert time.tokens(output, "heavy") > 0  # slowed, never stopped
    assert chat.error is None and len(chat.steps) == 12
    # Admitted and prefilled at the next step boundary, then a token every step: each at most
    # one target step after the one before.
    assert chat.steps[0] == submitted_at
    ends = [sum(o.predicted_ms for o in time.outputs[: i + 1]) for i in range(len(time.outputs))]
    gaps = [ends[b] - ends[a] for a, b in zip(chat.steps, chat.steps[1:], strict=False)]
    assert max(gaps) <= TARGET_MS
    # The light tenant gone for longer than `light_recent_s`, the flood has whole steps again.
    time.now += engine.scheduler.config.light_recent_s + 1.0
    output = time.step()
    assert not output.capped and time.tokens(output, "heavy") == 512


def test_per_step_scheduling_remembers_nothing_and_never_caps_a_step() -> None:
    engine = engine_for(
        "llama", max_num_batched_tokens=512, num_blocks=512, step_cost=COST, scheduling="per_step"
    )
    time = ScriptedTime(engine)
    flood(engine, "heavy", 4, 1000)
    engine.submit(make_request("chat", [9] * 20, tenant="light", max_tokens=12), Collector())
    for _ in range(5):
        output = time.step()
        assert not output.capped and sum(c.num_tokens for c in output.chunks) == 512
        assert not any(engine.scheduler.fair.counters.values())  # every step starts level


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_that_is_not_a_positive_number_is_refused_at_once(weight: float) -> None:
    engine = engine_for("llama")
    request = dataclasses.replace(make_request("bad", [5] * 10), weight=weight)
    with pytest.raises(InvalidRequest, match="weight"):
        engine.submit(request, Collector())


def test_a_tenant_that_got_more_in_past_steps_gets_less_now() -> None:
    engine = engine_for("llama", max_num_batched_tokens=BUDGET, num_blocks=512)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 8, 300)
    engine.submit(make_request("chat", [9] * 20, tenant="light", max_tokens=40), Collector())
    for _ in range(10):
        time.step()  # "light" decodes a token a step: "heavy" is served far more
    flood(engine, "light", 6, 300)
    output = time.step()
    # "light" is behind by up to a step's budget, so it is served first until level: more
    # than half of the step (a per-step split would give it exactly half).
    assert time.tokens(output, "light") > BUDGET // 2 + 1


def test_a_heavy_tenant_still_moves_when_light_work_alone_fills_the_target() -> None:
    slow_steps = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_ms=0.0)  # target 44 ms
    target_ms = slow_steps.default_target_ms()
    engine = engine_for("llama", max_num_batched_tokens=512, num_blocks=1024, step_cost=slow_steps)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 1, 1000)
    for i in range(40):  # 40 decodes: 50 ms predicted before any prefill
        engine.submit(
            make_request(f"c{i}", [9 + i] * 4, tenant="light", max_tokens=90), Collector()
        )
    floored = 0
    fair = engine.scheduler.fair
    output = time.step()
    while output.capped:
        gap = fair.counter("light") - fair.counter("heavy")
        heavy = time.tokens(output, "heavy")
        assert heavy > 0  # slowed, never stopped
        if output.predicted_ms - heavy * slow_steps.per_token_ms >= target_ms:
            assert heavy == MIN_CAPPED_PREFILL_TOKENS  # the light work alone filled the target
            floored += 1
        output = time.step()
    assert floored > 0
    # Steps are capped until "light" is a step's budget ahead: then its decodes no longer are.
    assert gap > fair.slack - 100


def test_a_capped_step_stops_trying_waiting_requests_once_its_time_is_spent() -> None:
    engine = engine_for("llama", max_num_batched_tokens=512, num_blocks=1024, step_cost=COST)
    time = ScriptedTime(engine)
    flood(engine, "heavy", 200, 40)
    engine.submit(make_request("chat", [9] * 20, tenant="light", max_tokens=4), Collector())
    matches = 0
    match = engine.cache.match

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal matches
        matches += 1
        return match(*args, **kwargs)  # type: ignore[arg-type]

    engine.cache.match = counting  # type: ignore[method-assign]
    output = time.step()
    assert output.capped
    # Only the requests that fit the target were looked up, not the whole queue.
    assert matches <= 2 + output.predicted_ms // (40 * COST.per_token_ms)
