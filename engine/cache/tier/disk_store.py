"""The disk tier: one file per worker, of fixed-size slots, with the index in memory.

File layout: a 4 KiB header (magic, the chain root, the slot size, a checksum), then slots of
`slot_size` bytes. A slot is a 256-byte header (magic, entry id, owner, value length,
priority, value, a checksum), then the sealed value. A free slot's header is all zeros.
Every value of one KV spec has the same size bound, so every entry costs one slot, and the
store charges each entry `slot_size` bytes against budgets and capacity.

A put writes the value first and its header last, so a crash between the two leaves a slot
whose header is zero or names the slot's previous entry (whose value no longer opens: a miss,
counted, never data). Reads take no lock while they read: a slot reused meanwhile bumps its
generation, and the read is then a miss.

On open, a file written for the same root and slot size keeps its entries: the index is
rebuilt from the slot headers (unsealed and small: an id, an owner, a length, a priority),
so a restarted worker keeps its disk tier. Nothing in a header is secret beyond which owner
holds how much (an id is keyed by its owner's data key: entry.py), and a tampered slot fails
its checksum or its value's tag. A file written for another model (root), block size or
format (the magic: version 2 has keyed ids) starts over. The directory is created 0700 and
the file 0600; a second worker opening the same file is refused (an advisory lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cache.block_hash import BlockHash
from engine.cache.budget import Owner
from engine.cache.eviction import aged_priority
from engine.cache.tier.entry import ENTRY_ID_BYTES
from engine.cache.tier.store import (
    Candidate,
    Eviction,
    OwnerIndex,
    OwnerUsage,
    PutPlan,
    PutView,
    Refused,
    TierBudget,
    TierStoreError,
    decide,
    eviction_order,
    owner_from_key,
    owner_key,
    plan_put,
    plan_shrink,
)

FILE_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
_SLOT_ALIGN = 512
# Version 2: entry ids keyed by their owner's data key; a version 1 file (unkeyed ids, which
# name guessable blocks to whoever reads it) starts over.
_FILE_MAGIC = b"PGTIER\x00\x02"
_SLOT_MAGIC = b"PGS1"
_OWNER_BYTES = 200
_CHECKSUM_BYTES = 8
_FILE_HEADER = struct.Struct("<8s32sQ")
_SLOT_HEADER = struct.Struct(f"<4s{ENTRY_ID_BYTES}sIddH{_OWNER_BYTES}s")
_ZERO_HEADER = bytes(SLOT_HEADER_BYTES)


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM_BYTES).digest()


def slot_size_for(max_value_bytes: int) -> int:
    """The slot that holds a header and a value of up to `max_value_bytes`."""
    raw = SLOT_HEADER_BYTES + max_value_bytes
    return -(-raw // _SLOT_ALIGN) * _SLOT_ALIGN


@dataclass(slots=True)
class _Slot:
    index: int
    owner: Owner
    length: int
    priority: float
    value: float


class DiskStore:
    """A `TierStore` in one file of fixed-size slots (see the module docstring)."""

    kind = "disk"

    def __init__(
        self,
        path: Path,
        root: BlockHash,
        capacity_bytes: int,
        max_value_bytes: int,
        default_budget: TierBudget | None = None,
    ) -> None:
        self.path = path
        self.root = root
        self.slot_size = slot_size_for(max_value_bytes)
        self.num_slots = capacity_bytes // self.slot_size
        self.capacity_bytes = self.num_slots * self.slot_size
        self.default_budget = default_budget or TierBudget(self.capacity_bytes)
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Slot] = {}
        self._by_owner: dict[Owner, set[bytes]] = {}
        self._generation = [0] * self.num_slots
        self._budgets: dict[Owner, TierBudget] = {}
        self._forgotten: set[Owner] = set()
        self._clock = 0.0
        self._fd = self._open_file(path)
        try:
            restored = self._read_file()
        except OSError:
            os.close(self._fd)
            raise
        used = {slot.index for slot in self._entries.values()}
        self._free = [i for i in reversed(range(self.num_slots)) if i not in used]
        if restored:
            self._clock = min(slot.priority for slot in self._entries.values())

    # -- the file -----------------------------------------------------------------------------

    @staticmethod
    def _open_file(path: Path) -> int:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
            path.parent.chmod(0o700)  # whatever the umask
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another worker has the tier file {path} open") from None
        except OSError:
            os.close(fd)
            raise
        return fd

    def _file_header(self) -> bytes:
        body = _FILE_HEADER.pack(_FILE_MAGIC, self.root, self.slot_size)
        return (body + _checksum(body)).ljust(FILE_HEADER_BYTES, b"\0")

    def _slot_offset(self, index: int) -> int:
        return FILE_HEADER_BYTES + index * self.slot_size

    def _read_file(self) -> int:
        """Rebuild the index from a file written for this root and slot size (else start
        the file over); returns how many entries it kept."""
        header = self._file_header()
        size = os.fstat(self._fd).st_size
        if os.pread(self._fd, FILE_HEADER_BYTES, 0) != header:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, header, 0)
            size = FILE_HEADER_BYTES
        old_slots = min(max(0, (size - FILE_HEADER_BYTES) // self.slot_size), self.num_slots)
        for index in range(old_slots):
            raw = os.pread(self._fd, SLOT_HEADER_BYTES, self._slot_offset(index))
            read = self._parse_slot(index, raw)
            if read is None:
                continue
            entry_id, slot = read
            if entry_id in self._entries:  # a torn re-put: keep one
                self._write_header(index, _ZERO_HEADER)
                continue
            self._index(entry_id, slot)
        os.ftruncate(self._fd, self._slot_offset(self.num_slots))
        return len(self._entries)

    def _parse_slot(self, index: int, raw: bytes) -> tuple[bytes, _Slot] | None:
        body, checksum = raw[: _SLOT_HEADER.size], raw[_SLOT_HEADER.size :][:_CHECKSUM_BYTES]
        if len(body) < _SLOT_HEADER.size or checksum != _checksum(body):
            return None
        magic, entry_id, length, priority, value, owner_length, owner = _SLOT_HEADER.unpack(body)
        if magic != _SLOT_MAGIC or length > self.slot_size - SLOT_HEADER_BYTES:
            return None
        try:
            owner_text = owner[:owner_length].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return entry_id, _Slot(index, owner_from_key(owner_text), length, priority, value)

    def _slot_header(self, entry_id: bytes, slot: _Slot) -> bytes:
        owner = owner_key(slot.owner).encode("utf-8")
        body = _SLOT_HEADER.pack(
            _SLOT_MAGIC, entry_id, slot.length, slot.priority, slot.value, len(owner), owner
        )
        return (body + _checksum(body)).ljust(SLOT_HEADER_BYTES, b"\0")

    def _write_header(self, index: int, header: bytes) -> None:
        os.pwrite(self._fd, header, self._slot_offset(index))

    # -- the index (callers hold the lock) ----------------------------------------------------

    def _index(self, entry_id: bytes, slot: _Slot) -> None:
        self._entries[entry_id] = slot
        self._by_owner.setdefault(slot.owner, set()).add(entry_id)

    def _unindex(self, entry_id: bytes) -> _Slot:
        slot = self._entries.pop(entry_id)
        owned = self._by_owner[slot.owner]
        owned.discard(entry_id)
        if not owned:
            del self._by_owner[slot.owner]
        self._generation[slot.index] += 1
        return slot

    def _remove(self, entry_id: bytes) -> None:
        slot = self._unindex(entry_id)
        self._write_header(slot.index, _ZERO_HEADER)
        self._free.append(slot.index)

    def _budget(self, owner: Owner) -> TierBudget:
        return self._budgets.get(owner, self.default_budget)

    def _view(
        self, owner: Owner, entry_id: bytes | None, wanted: frozenset[Owner], window: int
    ) -> PutView:
        owners: dict[Owner, OwnerIndex] = {}
        for holder in self._by_owner.keys() | {owner}:
            ids = self._by_owner.get(holder, set())
            lowest: tuple[Candidate, ...] = ()
            if holder in wanted and window:
                candidates = (self._candidate(i) for i in ids)
                lowest = tuple(heapq.nsmallest(window, candidates, key=eviction_order))
            owners[holder] = OwnerIndex(
                len(ids) * self.slot_size, len(ids), self._budget(holder), lowest
            )
        replaced = None
        if entry_id is not None and entry_id in self._entries:
            replaced = (self._entries[entry_id].owner, self._candidate(entry_id))
        return PutView(
            self.capacity_bytes,
            len(self._entries) * self.slot_size,
            self._clock,
            owners,
            replaced,
            owner in self._forgotten,
        )

    def _candidate(self, entry_id: bytes) -> Candidate:
        return Candidate(entry_id, self.slot_size, self._entries[entry_id].priority)

    def _evict(self, plan: PutPlan) -> None:
        for eviction in plan.evictions:
            self._remove(eviction.victim.entry_id)
        self._clock = plan.clock

    # -- TierStore ----------------------------------------------------------------------------

    def charged_bytes(self, size: int) -> int:
        return self.slot_size

    def put(self, entry_id: bytes, owner: Owner, sealed: bytes, value: float) -> PutPlan | Refused:
        """Store `sealed` in a slot of its own, after the evictions `plan_put` decides."""
        owner_length = len(owner_key(owner).encode("utf-8"))
        if len(sealed) > self.slot_size - SLOT_HEADER_BYTES or owner_length > _OWNER_BYTES:
            return Refused("too_large")
        with self._lock:
            plan = decide(
                lambda view: plan_put(owner, self.slot_size, value, view),
                lambda wanted, window: self._view(owner, entry_id, wanted, window),
            )
            if isinstance(plan, Refused):
                return plan
            try:
                self._evict(plan)
                if entry_id in self._entries:
                    self._remove(entry_id)
                index = self._free.pop()
                slot = _Slot(index, owner, len(sealed), plan.priority, value)
                # The value before its header: a header never names a value not yet written.
                self._write_header(index, _ZERO_HEADER)
                os.pwrite(self._fd, sealed, self._slot_offset(index) + SLOT_HEADER_BYTES)
                self._write_header(index, self._slot_header(entry_id, slot))
            except OSError as error:
                raise TierStoreError(f"disk tier write failed: {error}") from error
            self._generation[index] += 1
            self._index(entry_id, slot)
        return plan

    def get_many(self, entry_ids: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            found = [self._entries.get(entry_id) for entry_id in entry_ids]
            reads = [
                None if slot is None else (slot.index, slot.length, self._generation[slot.index])
                for slot in found
            ]
        values: list[bytes | None] = []
        try:
            for read in reads:
                if read is None:
                    values.append(None)
                    continue
                index, length, _ = read
                offset = self._slot_offset(index) + SLOT_HEADER_BYTES
                values.append(os.pread(self._fd, length, offset))
        except OSError as error:
            raise TierStoreError(f"disk tier read failed: {error}") from error
        with self._lock:  # a slot reused while it was read holds someone else's bytes now
            for position, read in enumerate(reads):
                if read is not None and self._generation[read[0]] != read[2]:
                    values[position] = None
        return values

    def contains(self, entry_ids: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [entry_id in self._entries for entry_id in entry_ids]

    def touch(self, entry_ids: Sequence[bytes], values: Sequence[float | None]) -> None:
        with self._lock:
            for entry_id, value in zip(entry_ids, values, strict=True):
                slot = self._entries.get(entry_id)
                if slot is None:
                    continue
                slot.priority = aged_priority(self._clock, slot.value if value is None else value)
                try:
                    self._write_header(slot.index, self._slot_header(entry_id, slot))
                except OSError as error:
                    raise TierStoreError(f"disk tier write failed: {error}") from error

    def delete(self, entry_ids: Sequence[bytes]) -> int:
        with self._lock:
            held = [entry_id for entry_id in entry_ids if entry_id in self._entries]
            self._remove_all(held)
            return len(held)

    def forget_owner(self, owner: Owner, limit: int) -> int:
        with self._lock:
            self._forgotten.add(owner)
            self._budgets.pop(owner, None)
            held = sorted(self._by_owner.get(owner, ()))[:limit]
            self._remove_all(held)
            return len(held)

    def set_budget(self, owner: Owner, budget: TierBudget) -> tuple[Eviction, ...]:
        with self._lock:
            self._budgets[owner] = budget
            plan = decide(
                lambda view: plan_shrink(owner, view),
                lambda wanted, window: self._view(owner, None, wanted, window),
            )
            assert isinstance(plan, PutPlan), "a shrink is never refused"
            self._remove_all([e.victim.entry_id for e in plan.evictions])
            self._clock = plan.clock
            return plan.evictions

    def usage(self) -> dict[Owner, OwnerUsage]:
        with self._lock:
            return {
                owner: OwnerUsage(len(ids) * self.slot_size, len(ids))
                for owner, ids in self._by_owner.items()
            }

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)  # closing the file releases its lock
                self._fd = -1

    def _remove_all(self, entry_ids: Sequence[bytes]) -> None:
        try:
            for entry_id in entry_ids:
                self._remove(entry_id)
        except OSError as error:
            raise TierStoreError(f"disk tier write failed: {error}") from error
