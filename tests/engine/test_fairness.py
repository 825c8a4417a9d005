"""The tenants' virtual counters (engine/fairness.py): water-filling and the lifts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.fairness import FairShare


def started(counters: dict[str, float], weights: dict[str, float] | None = None) -> FairShare:
    fair = FairShare(slack=100)
    fair.begin_step(weights or dict.fromkeys(counters, 1.0))
    fair.counters.update(counters)
    return fair


def test_equal_counters_split_the_budget_equally_and_pass_on_what_one_cannot_use() -> None:
    fair = started({"a": 0.0, "b": 0.0, "c": 0.0})
    assert fair.allowances(90, {"a": 100, "b": 100, "c": 100}) == {"a": 30, "b": 30, "c": 30}
    assert fair.allowances(90, {"a": 10, "b": 100, "c": 100}) == {"a": 10, "b": 40, "c": 40}


def test_the_least_served_tenant_is_served_first() -> None:
    fair = started({"a": 0.0, "b": 50.0})
    assert fair.allowances(40, {"a": 100, "b": 100}) == {"a": 40, "b": 0}
    assert fair.allowances(100, {"a": 100, "b": 100}) == {"a": 75, "b": 25}


def test_weights_share_in_proportion() -> None:
    fair = started({"a": 0.0, "b": 0.0}, {"a": 2.0, "b": 1.0})
    assert fair.allowances(90, {"a": 100, "b": 100}) == {"a": 60, "b": 30}
    fair.charge("a", 60)
    fair.charge("b", 30)
    assert fair.counter("a") == fair.counter("b") == 30.0  # service over weight


@given(
    budget=st.integers(1, 4096),
    tenants=st.lists(
        st.tuples(st.floats(0, 1e4), st.floats(0.01, 100), st.integers(0, 5000)),
        min_size=1,
        max_size=6,
    ),
)
def test_allowances_never_exceed_the_budget_or_a_demand_and_leave_nothing_wanted_unused(
    budget: int, tenants: list[tuple[float, float, int]]
) -> None:
    names = [f"t{i}" for i in range(len(tenants))]
    fair = started(
        {n: c for n, (c, _, _) in zip(names, tenants, strict=True)},
        {n: w for n, (_, w, _) in zip(names, tenants, strict=True)},
    )
    demands = {n: d for n, (_, _, d) in zip(names, tenants, strict=True)}
    shares = fair.allowances(budget, demands)
    assert sum(shares.values()) == min(budget, sum(demands.values()))
    assert all(0 <= shares.get(n, 0) <= demands[n] for n in names)


def test_a_tenant_back_from_idle_starts_at_the_lowest_counter_of_those_carrying_on() -> None:
    fair = FairShare(slack=100)
    fair.begin_step({"a": 1.0, "b": 1.0})
    fair.charge("a", 500)
    fair.charge("b", 300)
    fair.begin_step({"a": 1.0, "b": 1.0, "c": 1.0})
    # Level with b, not at nothing: no credit for the time it was away (the counters are kept
    # relative to the lowest, so b and c are at 0 and a 200 above them).
    assert fair.counter("c") == fair.counter("b") == 0.0 and fair.counter("a") == 200.0


def test_an_idle_tenant_that_was_ahead_stays_ahead_and_one_behind_is_forgotten() -> None:
    fair = FairShare(slack=100)
    fair.begin_step({"a": 1.0, "b": 1.0, "c": 1.0})
    fair.charge("a", 900)
    fair.charge("c", 100)
    fair.begin_step({"b": 1.0})  # a and c go idle; b carries on at 0
    assert "c" not in fair.counters or fair.counter("c") > fair.counter("b")
    fair.begin_step({"a": 1.0, "b": 1.0})
    assert fair.counter("a") == 900.0  # back, still owing what it had over b


def test_when_no_tenant_carries_on_every_counter_is_forgotten() -> None:
    fair = FairShare(slack=100)
    fair.begin_step({"a": 1.0})
    fair.charge("a", 10_000)
    fair.begin_step({"b": 1.0})  # a's work ended as b's began
    fair.begin_step({"a": 1.0, "b": 1.0})
    assert fair.counter("a") == fair.counter("b") == 0.0


def test_a_tenant_whose_demand_was_met_stays_within_slack_of_those_held_back() -> None:
    fair = FairShare(slack=100)
    fair.begin_step({"heavy": 1.0, "light": 1.0})
    fair.charge("heavy", 1000)
    fair.charge("light", 1)
    fair.end_step(held_back={"heavy"})
    assert fair.counter("light") == 900.0
    fair.end_step(held_back=set())  # nobody held back: within slack of the most served
    assert fair.counter("light") == 900.0


def test_per_step_sharing_remembers_nothing_and_ignores_weights() -> None:
    fair = FairShare(slack=100, remember=False)
    fair.begin_step({"a": 3.0, "b": 1.0})
    fair.charge("a", 1000)
    fair.end_step(held_back={"b"})
    fair.begin_step({"a": 3.0, "b": 1.0})
    assert fair.allowances(100, {"a": 100, "b": 100}) == {"a": 50, "b": 50}
