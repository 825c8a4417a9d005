"""Both stores keep the tier's contract: values by id, owners' bytes, quotas evicting the
owner's own lowest-priority entries, pressure never evicting another owner's reserved bytes,
refusals that change nothing, eviction in priority order with aging, and forgetting."""

from __future__ import annotations

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.tier.store import PutPlan, Refused, TierStore
from tests.engine.cache.tier.conftest import Backend, new_id, value_of


def put(store: TierStore, owner: str, value: float = 1.0) -> bytes:
    """Put a fresh entry for `owner`; return its id (the put must succeed)."""
    entry_id = new_id()
    assert isinstance(store.put(entry_id, owner, value_of(), value), PutPlan)
    return entry_id


def held(store: TierStore, entry_ids: list[bytes]) -> list[bool]:
    return store.contains(entry_ids)


def test_put_get_contains_delete(backend: Backend) -> None:
    store = backend.open()
    entry_id, data = new_id(), value_of()
    assert store.get_many([entry_id]) == [None]
    assert isinstance(store.put(entry_id, "t1", data, 1.0), PutPlan)
    absent = new_id()
    assert store.get_many([entry_id, absent]) == [data, None]
    assert store.contains([absent, entry_id]) == [False, True]
    usage = store.usage()
    assert usage["t1"].entries == 1 and usage["t1"].held_bytes == backend.entry_bytes
    assert store.delete([entry_id, absent]) == 1
    assert store.get_many([entry_id]) == [None]
    assert "t1" not in store.usage()


def test_public_budget_is_an_owner_of_its_own(backend: Backend) -> None:
    store = backend.open()
    entry_id = put(store, PUBLIC_OWNER)  # type: ignore[arg-type]
    assert set(store.usage()) == {PUBLIC_OWNER}
    assert store.contains([entry_id]) == [True]


def test_put_of_a_held_id_replaces_its_value(backend: Backend) -> None:
    store = backend.open()
    entry_id, newer = new_id(), value_of()
    store.put(entry_id, "t1", value_of(), 1.0)
    assert isinstance(store.put(entry_id, "t1", newer, 1.0), PutPlan)
    assert store.get_many([entry_id]) == [newer]
    assert store.usage()["t1"].entries == 1


def test_owner_over_its_quota_evicts_its_own_lowest_entries(backend: Backend) -> None:
    store = backend.open()
    store.set_budget("t1", backend.budget(3))
    other = [put(store, "t2", value=0.1) for _ in range(3)]  # lower than anything of t1's
    low, high, middle = put(store, "t1", 1.0), put(store, "t1", 5.0), put(store, "t1", 3.0)
    plan = store.put(new_id(), "t1", value_of(), 4.0)
    assert isinstance(plan, PutPlan)
    assert [(e.owner, e.victim.entry_id, e.cause) for e in plan.evictions] == [("t1", low, "own")]
    assert held(store, [low, high, middle]) == [False, True, True]
    assert all(held(store, other))
    assert store.usage()["t1"].entries == 3


def test_pressure_evicts_lowest_priority_above_reservations_only(backend: Backend) -> None:
    store = backend.open(entries=6)
    store.set_budget("t1", backend.budget(6, reserved_entries=2))
    t1 = [put(store, "t1", value=v) for v in (0.1, 0.2, 1.5)]  # one entry above its reservation
    t2 = [put(store, "t2", value=v) for v in (2.0, 1.0, 3.0)]

    def victims_of_put(owner: str) -> list[tuple[Owner, bytes, str]]:
        plan = store.put(new_id(), owner, value_of(), 9.0)
        assert isinstance(plan, PutPlan)
        return [(e.owner, e.victim.entry_id, e.cause) for e in plan.evictions]

    # The lowest entry overall, while t1 holds more than its reservation...
    assert victims_of_put("t3") == [("t1", t1[0], "pressure")]
    # ...then never t1's again: t2's in priority order...
    assert victims_of_put("t3") == [("t2", t2[1], "pressure")]
    assert victims_of_put("t3") == [("t2", t2[0], "pressure")]
    assert victims_of_put("t3") == [("t2", t2[2], "pressure")]
    # ...then the putting owner's own.
    assert [(owner, cause) for owner, _, cause in victims_of_put("t3")] == [("t3", "own")]
    assert held(store, t1) == [False, True, True]
    assert store.usage()["t1"].held_bytes == backend.budget(6, 2).reserved_bytes


def test_put_that_cannot_fit_is_refused_and_changes_nothing(backend: Backend) -> None:
    store = backend.open(entries=4)
    store.set_budget("t1", backend.budget(4, reserved_entries=2))
    store.set_budget("t2", backend.budget(4, reserved_entries=2))
    entries = [put(store, "t1") for _ in range(2)] + [put(store, "t2") for _ in range(2)]
    before = store.usage()
    assert store.put(new_id(), "t3", value_of(), 100.0) == Refused("capacity")
    assert store.usage() == before
    assert all(held(store, entries))


def test_value_larger_than_the_quota_is_refused(backend: Backend) -> None:
    store = backend.open()
    store.set_budget("t1", backend.budget(0))
    assert store.put(new_id(), "t1", value_of(), 1.0) == Refused("quota")
    assert "t1" not in store.usage()


def test_eviction_goes_lowest_first_and_old_entries_age_out(backend: Backend) -> None:
    """GreedyDual: the clock rises to each victim's priority, so an entry worth 5 outlives
    entries worth 1 for a while, then goes once newer entries rank above it."""
    store = backend.open(entries=3)
    valued = put(store, "t1", value=5.0)
    cheap = [put(store, "t1", value=1.0) for _ in range(2)]
    victims = []
    for _ in range(12):
        plan = store.put(new_id(), "t1", value_of(), 1.0)
        assert isinstance(plan, PutPlan) and len(plan.evictions) == 1
        victims.append(plan.evictions[0].victim.entry_id)
    assert set(victims[:2]) == set(cheap)
    assert valued in victims[4:]  # outlived at least four cheaper newcomers
    assert not held(store, [valued])[0]


def test_hit_raises_an_entry_above_newer_ones(backend: Backend) -> None:
    store = backend.open(entries=3)
    first, second, third = (put(store, "t1", value=1.0) for _ in range(3))
    store.touch([first, new_id()], [2.0, None])  # an absent id is skipped
    plan = store.put(new_id(), "t1", value_of(), 1.0)
    assert isinstance(plan, PutPlan)
    assert plan.evictions[0].victim.entry_id in {second, third}
    store.touch([plan.evictions[0].victim.entry_id], [None])  # gone: nothing comes back
    assert held(store, [first]) == [True]


def test_shrunk_budget_evicts_the_owners_lowest_entries_at_once(backend: Backend) -> None:
    store = backend.open()
    entries = [put(store, "t1", value=v) for v in (3.0, 1.0, 2.0, 4.0)]
    evictions = store.set_budget("t1", backend.budget(2))
    assert [e.victim.entry_id for e in evictions] == [entries[1], entries[2]]
    assert {e.cause for e in evictions} == {"own"}
    assert held(store, entries) == [True, False, False, True]


def test_forgotten_owner_loses_every_entry_and_its_puts_are_refused(backend: Backend) -> None:
    store = backend.open()
    doomed = [put(store, "t1") for _ in range(5)]
    kept = put(store, "t2")
    deleted = 0
    while True:
        batch = store.forget_owner("t1", limit=2)
        assert batch <= 2
        if not batch:
            break
        deleted += batch
    assert deleted == 5
    assert held(store, [*doomed, kept]) == [False] * 5 + [True]
    assert store.put(new_id(), "t1", value_of(), 1.0) == Refused("forgotten")
    assert set(store.usage()) == {"t2"}
