"""`plan_put` over random indexes: the quota, reservation and capacity guarantees hold for
every plan, a refusal means no allowed eviction could make room, and seeing the index a few
entries at a time (`decide`) plans exactly what seeing all of it does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.budget import Owner
from engine.cache.tier.store import (
    Candidate,
    OwnerIndex,
    PutPlan,
    PutView,
    Refused,
    TierBudget,
    decide,
    eviction_order,
    plan_put,
)

SIZE = 10
OWNERS = ["a", "b", "c"]


@st.composite
def indexes(draw: st.DrawFn) -> tuple[dict[str, list[Candidate]], dict[str, TierBudget], int]:
    entries: dict[str, list[Candidate]] = {}
    budgets: dict[str, TierBudget] = {}
    counter = 0
    for owner in OWNERS:
        priorities = draw(st.lists(st.integers(0, 20), max_size=8))
        entries[owner] = []
        for priority in priorities:
            counter += 1
            entries[owner].append(Candidate(counter.to_bytes(4, "big"), SIZE, float(priority)))
        quota = draw(st.integers(0, 12)) * SIZE
        # Reservations in bytes, not whole entries: an entry that would cut into one stays.
        budgets[owner] = TierBudget(quota, draw(st.integers(0, quota)))
    capacity = draw(st.integers(1, 20)) * SIZE
    return entries, budgets, capacity


def view_of(
    entries: dict[str, list[Candidate]],
    budgets: dict[str, TierBudget],
    capacity: int,
    shown: frozenset[Owner] = frozenset(OWNERS),
    window: int = 1000,
) -> PutView:
    owners: dict[Owner, OwnerIndex] = {
        owner: OwnerIndex(
            len(held) * SIZE,
            len(held),
            budgets[owner],
            tuple(sorted(held, key=eviction_order))[:window] if owner in shown else (),
        )
        for owner, held in entries.items()
    }
    used = sum(index.held_bytes for index in owners.values())
    return PutView(capacity, used, 0.0, owners)


@settings(max_examples=300, deadline=None)
@given(indexes(), st.sampled_from(OWNERS))
def test_every_plan_keeps_quotas_reservations_and_capacity(
    index: tuple[dict[str, list[Candidate]], dict[str, TierBudget], int], owner: str
) -> None:
    entries, budgets, capacity = index
    plan = plan_put(owner, SIZE, 1.0, view_of(entries, budgets, capacity))
    held: dict[Owner, int] = {o: len(e) * SIZE for o, e in entries.items()}
    if isinstance(plan, Refused):
        # Even every entry the rule may take would not make room.
        if plan.reason == "quota":  # all the owner's own entries gone, still over its quota
            assert budgets[owner].quota_bytes < SIZE
        else:
            assert plan.reason == "capacity"
            # Whole entries each other owner can lose and stay within its reservation.
            others = sum(
                max(0, held[o] - budgets[o].reserved_bytes) // SIZE * SIZE
                for o in OWNERS
                if o != owner
            )
            assert sum(held.values()) - held[owner] - others + SIZE > capacity
        return
    assert isinstance(plan, PutPlan)
    for eviction in plan.evictions:
        held[eviction.owner] -= eviction.victim.size
        assert eviction.cause == ("own" if eviction.owner == owner else "pressure")
    assert held[owner] + SIZE <= budgets[owner].quota_bytes
    assert sum(held.values()) + SIZE <= capacity
    for other in OWNERS:
        evicted = [e.victim for e in plan.evictions if e.owner == other]
        if other != owner and evicted:
            assert held[other] >= budgets[other].reserved_bytes
        # Each owner loses its lowest entries: no survivor ranks below a victim.
        survivors = [c for c in entries[other] if c not in evicted]
        for victim in evicted:
            assert all(
                (victim.priority, victim.entry_id) <= (s.priority, s.entry_id) for s in survivors
            )
    assert plan.clock == max([0.0, *(e.victim.priority for e in plan.evictions)])
    assert plan.priority == plan.clock + 1.0


@settings(max_examples=200, deadline=None)
@given(indexes(), st.sampled_from(OWNERS))
def test_widening_views_plan_what_the_whole_index_plans(
    index: tuple[dict[str, list[Candidate]], dict[str, TierBudget], int], owner: str
) -> None:
    entries, budgets, capacity = index
    whole = plan_put(owner, SIZE, 1.0, view_of(entries, budgets, capacity))
    views: list[tuple[frozenset[Owner], int]] = []

    def partial(shown: frozenset[Owner], window: int) -> PutView:
        views.append((shown, window))
        return view_of(entries, budgets, capacity, shown, window)

    assert decide(lambda view: plan_put(owner, SIZE, 1.0, view), partial) == whole
    assert views[0] == (frozenset(), 0)  # the first look shows no entries at all
