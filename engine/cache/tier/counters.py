"""What the tier did, per owner: offloads and drops, loads and misses by reason, evictions."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from engine.cache.budget import Owner
from engine.cache.tier.store import Refusal

# Why a wanted block did not come back: the store holds no such entry; there is no key for it
# (none given, its owner forgotten, or the value was sealed under another key id); its tag
# failed (tampered, moved to another entry or model); it decoded to another block's identity
# (a collision, I3); it is not a value the tier writes; the store failed.
MissReason = Literal["absent", "key", "tag", "identity", "malformed", "error"]
# Why an offload was not stored: the queue was full, or a store refusal, or the store failed.
DropReason = Literal["queue", "error"] | Refusal


@dataclass(slots=True)
class TierCounters:
    """Running totals of one owner's tier traffic, as one worker saw it."""

    offloads: int = 0
    offloaded_bytes: int = 0
    # Offloads of blocks the tier held already (their priority raised, nothing written).
    present: int = 0
    drops: Counter[DropReason] = field(default_factory=Counter)
    loads: int = 0
    loaded_bytes: int = 0
    misses: Counter[MissReason] = field(default_factory=Counter)
    evicted_own: int = 0
    evicted_pressure: int = 0
    purged: int = 0

    def copy(self) -> TierCounters:
        return dataclasses.replace(self, drops=Counter(self.drops), misses=Counter(self.misses))

    @property
    def dropped(self) -> int:
        return self.drops.total()

    @property
    def missed(self) -> int:
        return self.misses.total()


@dataclass(frozen=True, slots=True)
class TierOwnerStats:
    """An owner's bytes and entries in the store now (every worker's, on a shared store) and
    this worker's running totals for it."""

    held_bytes: int
    entries: int
    counters: TierCounters


@dataclass(frozen=True, slots=True)
class TierStats:
    """The tier at one moment."""

    kind: str
    capacity_bytes: int
    queued: int
    owners: dict[Owner, TierOwnerStats]

    @property
    def used_bytes(self) -> int:
        return sum(owner.held_bytes for owner in self.owners.values())
