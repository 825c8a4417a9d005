"""The tier's store: sealed values by entry id, each owner's bytes and budget, and the one rule
that decides what a put evicts.

A store holds opaque values (sealed blocks) under entry ids, each charged to an owner and
ranked by a priority: `aged_priority(clock, value)`, where the store's clock is the priority
of the last entry it evicted, so entries that stop being hit age out (GreedyDual). A hit
raises an entry's priority to the clock plus its value again.

`plan_put` decides every put, for every backend and every worker sharing one:
- an owner that would go over its quota evicts its own lowest-priority entries;
- a store that would go over its capacity evicts the lowest-priority entries among owners
  above their reservation, the putting owner's own included (whatever its reservation);
  another owner never loses an entry that would leave it holding less than its reservation;
- what cannot fit is refused, and the put changes nothing.
Each eviction is *own* (the owner made room for itself) or *pressure* (another owner's put).
`plan_put` is pure: a store hands it a small view of its index (each owner's bytes, budget
and lowest-priority entries, as many as the plan asked for) and carries out what it returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.eviction import aged_priority

# Why a put was dropped: over the owner's quota even with all its entries gone, no room among
# entries others may lose, too large for the store, or its owner was forgotten (deleted).
Refusal = Literal["quota", "capacity", "too_large", "forgotten"]
EvictionCause = Literal["own", "pressure"]

# Tenant ids are never empty (tenancy makes UUIDs), so "" names the public budget, as on the
# wire to workers (gateway/workers/wire.py).
_PUBLIC_KEY = ""
# The owner calibration's throwaway entries are charged to: no tenant id holds a NUL.
CALIBRATION_OWNER: Owner = "\x00calibration"


def owner_key(owner: Owner) -> str:
    """An owner as a store writes it: its tenant id, or "" for the public budget."""
    if owner is PUBLIC_OWNER:
        return _PUBLIC_KEY
    assert isinstance(owner, str) and owner, "tenant ids are never empty"
    return owner


def owner_from_key(text: str) -> Owner:
    """The owner `owner_key` wrote as `text`."""
    return PUBLIC_OWNER if text == _PUBLIC_KEY else text


@dataclass(frozen=True, slots=True)
class TierBudget:
    """An owner's quota in the tier (bytes it may hold) and its reservation (bytes of it that
    other owners' puts can never evict)."""

    quota_bytes: int
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        if self.quota_bytes < 0:
            raise ValueError("quota_bytes must not be negative")
        if not 0 <= self.reserved_bytes <= self.quota_bytes:
            raise ValueError("reserved_bytes must be between 0 and quota_bytes")


@dataclass(frozen=True, slots=True)
class Candidate:
    """An entry as the rule sees it: a possible victim."""

    entry_id: bytes
    size: int
    priority: float


def eviction_order(candidate: Candidate) -> tuple[float, bytes]:
    """Sort key of victims: lowest priority first, ties by entry id (as a Redis sorted set
    orders members of one score: by their hex ids, the same order)."""
    return candidate.priority, candidate.entry_id


@dataclass(frozen=True, slots=True)
class OwnerIndex:
    """One owner's share of the store: bytes and entries held, its budget, and its
    lowest-priority entries (lowest first; all of them when `len(lowest) == entries`)."""

    held_bytes: int
    entries: int
    budget: TierBudget
    lowest: tuple[Candidate, ...] = ()

    @property
    def complete(self) -> bool:
        return len(self.lowest) >= self.entries


@dataclass(frozen=True, slots=True)
class PutView:
    """What `plan_put` needs of a store's index. `owners` holds every owner with entries and
    the putting owner; `replaced` is an entry of the put's own id (a re-put), which the put
    overwrites."""

    capacity_bytes: int
    used_bytes: int
    clock: float
    owners: Mapping[Owner, OwnerIndex]
    replaced: tuple[Owner, Candidate] | None = None
    forgotten: bool = False


@dataclass(frozen=True, slots=True)
class Eviction:
    owner: Owner
    victim: Candidate
    cause: EvictionCause


@dataclass(frozen=True, slots=True)
class PutPlan:
    """The evictions that make room, the store's clock after them, and the new entry's
    priority."""

    evictions: tuple[Eviction, ...]
    clock: float
    priority: float


@dataclass(frozen=True, slots=True)
class Refused:
    reason: Refusal


@dataclass(frozen=True, slots=True)
class WiderView:
    """The rule cannot decide before it sees more of these owners' lowest entries."""

    owners: frozenset[Owner]


class TierStoreError(Exception):
    """The store could not be reached or read (a Redis error, an I/O error): the caller
    counts a drop or a miss and goes on."""


@dataclass(frozen=True, slots=True)
class OwnerUsage:
    held_bytes: int
    entries: int


def plan_put(owner: Owner, size: int, value: float, view: PutView) -> PutPlan | Refused | WiderView:
    """Decide a put of `size` bytes worth `value` for `owner` (see the module docstring)."""
    if view.forgotten:
        return Refused("forgotten")
    room = _Room(view)
    if size > room.budget(owner).quota_bytes:
        return Refused("quota")
    if size > view.capacity_bytes:
        return Refused("capacity")
    own = room.evict_own(owner, size)
    if not isinstance(own, bool):
        return own
    if not own:
        return Refused("quota")
    pressure = room.evict_pressure(owner, size)
    if not isinstance(pressure, bool):
        return pressure
    if not pressure:
        return Refused("capacity")
    return room.plan(value)


def plan_shrink(owner: Owner, view: PutView) -> PutPlan | WiderView:
    """The owner's own evictions that bring it within its (new) quota."""
    room = _Room(view)
    own = room.evict_own(owner, 0)
    if isinstance(own, WiderView):
        return own
    return room.plan(0.0)


class _Room:
    """A plan in the making: what each owner holds once the chosen victims are gone."""

    def __init__(self, view: PutView) -> None:
        self.view = view
        self.held = {owner: index.held_bytes for owner, index in view.owners.items()}
        self.used = view.used_bytes
        self.evictions: list[Eviction] = []
        skip = b""
        if view.replaced is not None:
            replaced_owner, replaced = view.replaced
            self.held[replaced_owner] = self.held.get(replaced_owner, 0) - replaced.size
            self.used -= replaced.size
            skip = replaced.entry_id
        self.queues = {
            owner: deque(c for c in index.lowest if c.entry_id != skip)
            for owner, index in view.owners.items()
        }

    def budget(self, owner: Owner) -> TierBudget:
        return self.view.owners[owner].budget

    def _hidden(self, owner: Owner) -> bool:
        """Whether the owner has entries the view does not show and the plan may need."""
        return not self.queues[owner] and not self.view.owners[owner].complete

    def _evict(self, owner: Owner, cause: EvictionCause) -> Candidate:
        victim = self.queues[owner].popleft()
        self.evictions.append(Eviction(owner, victim, cause))
        self.held[owner] -= victim.size
        self.used -= victim.size
        return victim

    def evict_own(self, owner: Owner, size: int) -> bool | WiderView:
        """Evict the owner's lowest entries until `size` more bytes fit its quota; False when
        even all of them are not enough."""
        while self.held[owner] + size > self.budget(owner).quota_bytes:
            if self._hidden(owner):
                return WiderView(frozenset({owner}))
            if not self.queues[owner]:
                return False
            self._evict(owner, "own")
        return True

    def evict_pressure(self, owner: Owner, size: int) -> bool | WiderView:
        """Evict the lowest entries among owners above their reservation (the putting owner's
        own whatever its reservation) until `size` more bytes fit the store; False when they
        are not enough."""
        # What each owner may still lose; another owner never drops below its reservation.
        allowance: dict[Owner, float] = {
            other: self.held[other] - index.budget.reserved_bytes
            for other, index in self.view.owners.items()
        }
        allowance[owner] = float("inf")
        while self.used + size > self.view.capacity_bytes:
            eligible = [other for other, left in allowance.items() if left > 0]
            hidden = frozenset(other for other in eligible if self._hidden(other))
            if hidden:
                return WiderView(hidden)
            heads = [other for other in eligible if self.queues[other]]
            if not heads:
                return False
            victim_owner = min(heads, key=lambda other: eviction_order(self.queues[other][0]))
            if self.queues[victim_owner][0].size > allowance[victim_owner]:
                allowance[victim_owner] = 0  # its next entry would cut into its reservation
                continue
            victim = self._evict(victim_owner, "own" if victim_owner == owner else "pressure")
            allowance[victim_owner] -= victim.size
        return True

    def plan(self, value: float) -> PutPlan:
        clock = max([self.view.clock, *(e.victim.priority for e in self.evictions)])
        return PutPlan(tuple(self.evictions), clock, aged_priority(clock, value))


def decide(
    rule: Callable[[PutView], PutPlan | Refused | WiderView],
    view: Callable[[frozenset[Owner], int], PutView],
) -> PutPlan | Refused:
    """Run `rule` over views that show more of the owners it asks for until it decides.

    `view(owners, window)` shows up to `window` lowest entries of each of `owners`; the first
    view shows none, since most puts evict nothing.
    """
    owners: frozenset[Owner] = frozenset()
    window = 0
    while True:
        decision = rule(view(owners, window))
        if not isinstance(decision, WiderView):
            return decision
        owners |= decision.owners
        window = max(8, window * 4)


class TierStore(Protocol):
    """Sealed values by entry id, each charged to an owner, with budgets and eviction by
    priority; put decides with `plan_put`."""

    kind: str
    capacity_bytes: int

    def put(self, entry_id: bytes, owner: Owner, sealed: bytes, value: float) -> PutPlan | Refused:
        """Store `sealed` under `entry_id` for `owner` (replacing an entry of that id), or
        refuse it; returns the plan carried out."""
        ...

    def charged_bytes(self, size: int) -> int:
        """The bytes an entry of `size` bytes counts for against budgets and capacity."""
        ...

    def get_many(self, entry_ids: Sequence[bytes]) -> list[bytes | None]:
        """The values of these entries (None: absent), in one batch."""
        ...

    def contains(self, entry_ids: Sequence[bytes]) -> list[bool]:
        """Whether each entry is held now, in one batch."""
        ...

    def touch(self, entry_ids: Sequence[bytes], values: Sequence[float | None]) -> None:
        """Raise entries' priorities after a hit: the clock plus the value given (None: the
        value they were put with); absent entries are skipped."""
        ...

    def delete(self, entry_ids: Sequence[bytes]) -> int:
        """Delete these entries; returns how many were held."""
        ...

    def forget_owner(self, owner: Owner, limit: int) -> int:
        """Refuse the owner's puts from now on and delete up to `limit` of its entries;
        returns how many were deleted (0: none is left)."""
        ...

    def set_budget(self, owner: Owner, budget: TierBudget) -> tuple[Eviction, ...]:
        """Set an owner's budget for every user of the store; evicts what is over its quota."""
        ...

    def usage(self) -> dict[Owner, OwnerUsage]:
        """Bytes and entries each owner holds now."""
        ...

    def close(self) -> None: ...
