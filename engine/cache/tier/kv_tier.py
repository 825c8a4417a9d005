"""The second tier as the engine sees it: offload a block, probe for keys, load blocks back.

Offloads never block the step: `offload` queues a CPU copy of the block's KV and a background
thread seals it (AES-256-GCM under the owner's key, bound to root and block key) and puts it
in the store, whose one rule (`plan_put`) decides what it evicts or whether it is refused.
A full queue drops the offload and counts it. Loads are synchronous and batched: fetch,
unseal, check the identity, reshape; every failure is a miss counted by its reason, never
data. Forgetting an owner (its tenant deleted) drops its queued offloads, refuses new ones and
deletes its entries in the background; its key is gone already, so they were unreadable from
the moment it was deleted (crypto-shredding).

Entry ids are keyed by the data key a block is sealed with (entry.py), so every offload,
probe and load names each block's key. A discard names blocks by their keys alone (a failed
request's, a withdrawn public prefix's), so the tier remembers the ids it made for the most
recent blocks it offloaded, probed or loaded, and deletes those: on a shared store every
worker is told of a discard and deletes the ids it made. Ids it no longer remembers stay
until they are evicted (a withdrawn prefix's key is shredded: they are unreadable already).

Whether a hit is worth loading is the caller's call, with the speed `calibrate` measured:
`TierSpeed.cheaper_than` (speed.py) is that rule's one home.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.block_hash import BlockHash
from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import Public
from engine.cache.tier.counters import (
    DropReason,
    MissReason,
    TierCounters,
    TierOwnerStats,
    TierStats,
)
from engine.cache.tier.entry import (
    TierBlock,
    block_plaintext,
    entry_ids,
    kv_of,
    sealed_size_bound,
)
from engine.cache.tier.sealing import SealKey, open_sealed, seal
from engine.cache.tier.speed import TierSpeed as TierSpeed  # its users import it from here
from engine.cache.tier.store import (
    CALIBRATION_OWNER,
    Eviction,
    OwnerUsage,
    PutPlan,
    TierBudget,
    TierStore,
    TierStoreError,
)

logger = logging.getLogger(__name__)

# Entries a purge deletes per store call, so offloads and other purges are never held up long.
_PURGE_BATCH = 512
# How long the worker waits before it retries a purge the store failed.
_RETRY_S = 1.0
# How long probes skip a store that just failed, in seconds.
OUTAGE_S = 5.0
# How often the background thread reads the store's usage for `snapshot`, in seconds.
USAGE_EVERY_S = 1.0
# Block keys whose entry ids the tier remembers for discards (about 150 bytes each).
REMEMBERED_BLOCKS = 1 << 16


@dataclass(frozen=True, slots=True)
class _Offload:
    block: TierBlock
    block_id: bytes
    seal_key: SealKey
    kv: torch.Tensor
    value: float


@dataclass(frozen=True, slots=True)
class _Purge:
    owner: Owner


@dataclass(frozen=True, slots=True)
class _SetBudget:
    owner: Owner
    budget: TierBudget


@dataclass(frozen=True, slots=True)
class _Discard:
    """Entries whose value can never be read (tampered, damaged, or another block's): while
    they stay, the block's offload finds them present and never replaces them."""

    entry_ids: list[bytes]


class KVTier:
    """Offloads, probes and loads of sealed blocks in a `TierStore`, for one worker."""

    def __init__(
        self,
        store: TierStore,
        spec: KVSpec,
        root: BlockHash,
        *,
        queue_blocks: int = 256,
        remembered_blocks: int = REMEMBERED_BLOCKS,
    ) -> None:
        self.store = store
        self.spec = spec
        self.root = root
        self.queue_blocks = queue_blocks
        self.remembered_blocks = remembered_blocks
        # Block key -> the entry ids made for it (one per data key), least recent first.
        self._ids_lock = threading.Lock()
        self._ids: OrderedDict[BlockHash, tuple[bytes, ...]] = OrderedDict()
        self.shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._cond = threading.Condition()
        self._offloads: deque[_Offload] = deque()
        # Purges and budgets go before offloads.
        self._controls: deque[_Purge | _SetBudget | _Discard] = deque()
        self._busy = False
        self._closed = False
        self._forgotten: set[Owner] = set()
        self._counters_lock = threading.Lock()
        self._counters: dict[Owner, TierCounters] = {}
        # The store's usage as the background thread last read it (`snapshot`), and when.
        self._usage: dict[Owner, OwnerUsage] = {}
        # Until when probes answer "absent" without asking: the store failed just before.
        self._down_until = 0.0
        self._usage_read = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-tier", daemon=True)
        self._thread.start()

    @property
    def bytes_per_entry(self) -> int:
        """What one block costs against tier budgets and capacity, at most (to turn a quota
        in blocks into bytes)."""
        return self.store.charged_bytes(sealed_size_bound(self.spec))

    # -- the engine's side ----------------------------------------------------------------------

    def offload(self, block: TierBlock, seal_key: SealKey, kv: torch.Tensor, value: float) -> bool:
        """Queue a block's KV (a CPU copy the caller made) to be sealed and stored; False
        (a drop, counted) when the queue is full or the owner was forgotten. Never blocks."""
        if tuple(kv.shape) != self.shape or kv.dtype != self.spec.dtype or kv.device.type != "cpu":
            raise ValueError(
                f"a tier block is a CPU tensor {self.shape} of {self.spec.dtype}, "
                f"not {kv.device.type} {tuple(kv.shape)} of {kv.dtype}"
            )
        (block_id,) = self._ids_of([block.key], [seal_key])
        reason: DropReason
        with self._cond:
            if block.owner in self._forgotten:
                reason = "forgotten"
            elif len(self._offloads) >= self.queue_blocks or self._closed:
                reason = "queue"
            else:
                self._offloads.append(_Offload(block, block_id, seal_key, kv, value))
                self._cond.notify()
                return True
        self._drop(block.owner, reason)
        return False

    def contains(
        self, keys: Sequence[BlockHash], seal_keys: Sequence[SealKey | None]
    ) -> list[bool]:
        """Whether the store holds each block, sealed with the data key beside it, now (one
        batched probe; False for a block without a key, for all if the probe fails, and for
        `OUTAGE_S` after a failure, so an unreachable store costs the engine thread one
        timeout, not one per request)."""
        if len(seal_keys) != len(keys):
            raise ValueError("one seal key per block key")
        keyed = [(i, seal_key) for i, seal_key in enumerate(seal_keys) if seal_key is not None]
        present = [False] * len(keys)
        if not keyed or time.monotonic() < self._down_until:
            return present
        ids = self._ids_of([keys[i] for i, _ in keyed], [seal_key for _, seal_key in keyed])
        try:
            held = self.store.contains(ids)
        except TierStoreError:
            self._down_until = time.monotonic() + OUTAGE_S
            return present
        for (i, _), is_held in zip(keyed, held, strict=True):
            present[i] = is_held
        return present

    def load(
        self,
        wanted: Sequence[TierBlock],
        seal_keys: Sequence[SealKey | None],
        values: Sequence[float] | None = None,
        *,
        chain: bool = False,
    ) -> list[torch.Tensor | None]:
        """Each wanted block's KV (shaped as offloaded) or None for a miss, counted by reason.

        A hit raises its entry's priority: the clock plus `values[i]` when given (the block's
        value with this hit observed), else plus the value it was offloaded with. With `chain`
        the blocks are one chain's, of which only the run before the first miss is of use:
        nothing after it is opened, counted or returned. An entry that fails its tag, its
        identity or its shape is deleted (in the background), so the block's next offload
        stores a good value in its place.
        """
        if len(seal_keys) != len(wanted) or (values is not None and len(values) != len(wanted)):
            raise ValueError("one seal key (and value) per wanted block")
        results, misses, ids = self._open(wanted, seal_keys, chain)
        unreadable = [
            ids[i] for i, reason in misses.items() if reason in ("tag", "identity", "malformed")
        ]
        if unreadable:
            with self._cond:
                self._controls.append(_Discard(unreadable))
                self._cond.notify()
        hits = [i for i, kv in enumerate(results) if kv is not None]
        with self._counters_lock:
            for i in hits:
                counters = self._tally(wanted[i].owner)
                counters.loads += 1
                counters.loaded_bytes += self.spec.bytes_per_block
            for i, reason in misses.items():
                self._tally(wanted[i].owner).misses[reason] += 1
        if hits:
            try:
                self.store.touch(
                    [ids[i] for i in hits], [None if values is None else values[i] for i in hits]
                )
            except TierStoreError:
                logger.warning("kv tier: raising the priority of %d hits failed", len(hits))
        return results

    def _open(
        self, wanted: Sequence[TierBlock], seal_keys: Sequence[SealKey | None], chain: bool
    ) -> tuple[list[torch.Tensor | None], dict[int, MissReason], dict[int, bytes]]:
        """Fetch, unseal and check blocks: each one's KV or None, why each miss missed (with
        `chain`, up to the first miss only), and the entry id of each block fetched."""
        results: list[torch.Tensor | None] = [None] * len(wanted)
        misses: dict[int, MissReason] = {}
        with self._cond:
            forgotten = set(self._forgotten)
        fetch: list[int] = []
        fetch_keys: list[SealKey] = []
        for i, (block, key) in enumerate(zip(wanted, seal_keys, strict=True)):
            if key is None or block.owner in forgotten:
                misses[i] = "key"
                if chain:
                    break
            else:
                fetch.append(i)
                fetch_keys.append(key)
        fetch_ids = self._ids_of([wanted[i].key for i in fetch], fetch_keys)
        ids = dict(zip(fetch, fetch_ids, strict=True))
        try:
            values = self.store.get_many(fetch_ids)
        except TierStoreError:
            self._down_until = time.monotonic() + OUTAGE_S
            values = []
            misses.update(dict.fromkeys(fetch, "error"))
        for i, value in zip(fetch, values, strict=False):
            if chain and any(miss < i for miss in misses):
                break
            key = seal_keys[i]
            assert key is not None
            block = wanted[i]
            opened = None if value is None else open_sealed(key, self.root, block.key, value)
            if opened is None:
                misses[i] = "absent"
            elif not isinstance(opened, bytes):
                misses[i] = opened
            elif (kv := kv_of(block, opened)) is None:
                misses[i] = "identity"
            elif len(kv) != self.spec.bytes_per_block:
                misses[i] = "malformed"
            else:
                flat = torch.frombuffer(bytearray(kv), dtype=self.spec.dtype)
                results[i] = flat.view(self.shape)
        return results, misses, ids

    def set_budget(self, owner: Owner, budget: TierBudget) -> None:
        """Give an owner its tier budget (applied in the background: a shrink evicts)."""
        with self._cond:
            if owner not in self._forgotten:
                self._controls.append(_SetBudget(owner, budget))
                self._cond.notify()

    def forget_owner(self, owner: Owner) -> None:
        """Drop the owner's queued offloads, refuse new ones, and delete its entries in the
        background (on a shared store, every worker's)."""
        if owner is PUBLIC_OWNER:
            raise ValueError("the public budget is never forgotten; drop its prefixes' keys")
        with self._cond:
            self._forgotten.add(owner)
            kept = deque(job for job in self._offloads if job.block.owner != owner)
            dropped = len(self._offloads) - len(kept)
            self._offloads = kept
            self._controls.append(_Purge(owner))
            self._cond.notify()
        for _ in range(dropped):
            self._drop(owner, "forgotten")

    def discard(self, keys: Sequence[BlockHash]) -> None:
        """Forget these blocks: their queued offloads are dropped and the entries this tier
        made ids for (see the module docstring) deleted in the background (a failed request's
        KV, a withdrawn public prefix). Never blocks."""
        if not keys:
            return
        with self._ids_lock:
            ids = [i for key in keys for i in self._ids.pop(key, ())]
        wanted = set(keys)
        with self._cond:
            self._offloads = deque(job for job in self._offloads if job.block.key not in wanted)
            self._controls.append(_Discard(ids))
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued offload, budget and purge is done; TimeoutError if not."""
        with self._cond:
            idle = self._cond.wait_for(
                lambda: not (self._offloads or self._controls or self._busy), timeout
            )
        if not idle:
            raise TimeoutError(f"the kv tier still had work queued after {timeout} s")

    def close(self) -> None:
        """Stop the background thread (queued work is abandoned) and close the store."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.store.close()

    # -- numbers --------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        """Each owner's bytes and entries in the store and this worker's totals for it."""
        try:
            usage = self.store.usage()
        except TierStoreError:
            usage = {}
        return self._stats(usage)

    def snapshot(self) -> TierStats:
        """`stats` without reading the store: its usage as of the background thread's last
        read (at most `USAGE_EVERY_S` old while the tier is idle), so the engine thread may
        take it at every step."""
        with self._cond:
            usage = self._usage
        return self._stats(usage)

    def _stats(self, usage: dict[Owner, OwnerUsage]) -> TierStats:
        with self._counters_lock:
            counters = {owner: c.copy() for owner, c in self._counters.items()}
        with self._cond:
            queued = len(self._offloads)
        owners = {
            owner: TierOwnerStats(
                usage.get(owner, OwnerUsage(0, 0)).held_bytes,
                usage.get(owner, OwnerUsage(0, 0)).entries,
                counters.get(owner, TierCounters()),
            )
            for owner in usage.keys() | counters.keys()
            if not (isinstance(owner, str) and owner.startswith(str(CALIBRATION_OWNER)))
        }
        return TierStats(self.store.kind, self.store.capacity_bytes, queued, owners)

    def calibrate(self, samples: int = 8) -> TierSpeed:
        """Time loads of one block and of `samples` blocks at once (fetch, unseal, check,
        raise priority) under a throwaway key and owner, then delete them; a fit of latency
        and bandwidth. Raises `TierStoreError` when the store fails or refuses the samples.

        Loads are what the cost rule weighs; puts happen off the step. The store may evict
        other owners' unreserved entries to make room for the samples, as for any put.
        """
        if samples < 2:
            raise ValueError("calibration needs at least 2 samples")
        key = SealKey("calibration", os.urandom(32))
        # This start's own owner: engines calibrating at once on one store never take each
        # other's samples.
        owner = f"{CALIBRATION_OWNER}-{os.urandom(4).hex()}"
        blocks = [
            TierBlock(
                BlockHash(os.urandom(32)),
                BlockHash(os.urandom(32)),
                Public("\x00calibration"),
                bytes(4 * self.spec.block_size),
                owner,
            )
            for _ in range(samples)
        ]
        kv_bytes = os.urandom(self.spec.bytes_per_block)
        ids = entry_ids(self.root, [block.key for block in blocks], [key] * samples)
        try:
            budget = TierBudget(2 * samples * self.bytes_per_entry)
            self.store.set_budget(owner, budget)
            for block, block_id in zip(blocks, ids, strict=True):
                sealed = seal(key, self.root, block.key, block_plaintext(block, kv_bytes))
                stored = self.store.put(block_id, owner, sealed, 0.0)
                if not isinstance(stored, PutPlan):
                    raise TierStoreError(f"the store refused calibration's blocks: {stored}")
                self._count_evictions(stored.evictions)
            one = statistics.median(self._time_load([block], key) for block in blocks)
            many = statistics.median(self._time_load(blocks, key) for _ in range(3))
        finally:
            self.store.delete(ids)
            self.store.forget_owner(owner, len(ids))
            with self._ids_lock:  # its loads remembered the samples' ids
                for block in blocks:
                    self._ids.pop(block.key, None)
            with self._counters_lock:
                self._counters.pop(owner, None)
        return TierSpeed.fit(one, many, samples, self.spec.bytes_per_block)

    def _time_load(self, blocks: Sequence[TierBlock], key: SealKey) -> float:
        """Milliseconds `load` takes for `blocks` (priority updates included)."""
        start = time.perf_counter()
        loaded = self.load(blocks, [key] * len(blocks))
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if any(kv is None for kv in loaded):
            raise TierStoreError("calibration's blocks did not load back")
        return elapsed_ms

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._controls or self._offloads, USAGE_EVERY_S
                )
                if self._closed:
                    return
                stale = time.monotonic() - self._usage_read >= USAGE_EVERY_S
                if stale or not (self._controls or self._offloads):
                    job = None
                else:
                    job = self._controls.popleft() if self._controls else self._offloads.popleft()
                    self._busy = True
            if job is None:
                self._read_usage()
                continue
            try:
                self._do(job)
            except Exception:  # a bug must not stop every later offload
                logger.exception("kv tier: %s failed", type(job).__name__)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _read_usage(self) -> None:
        try:
            usage = self.store.usage()
        except TierStoreError:
            logger.warning("kv tier: reading the store's usage failed")
            usage = None
        with self._cond:
            self._usage_read = time.monotonic()
            if usage is not None:
                self._usage = usage

    def _do(self, job: _Offload | _Purge | _SetBudget | _Discard) -> None:
        match job:
            case _Offload():
                self._store(job)
            case _Purge(owner):
                try:
                    deleted = self.store.forget_owner(owner, _PURGE_BATCH)
                except TierStoreError:
                    logger.warning("kv tier: purging %r failed; retrying", owner)
                    time.sleep(_RETRY_S)
                    deleted = -1
                with self._counters_lock:
                    self._tally(owner).purged += max(0, deleted)
                if deleted:  # more may be left, or the store failed: go on later
                    with self._cond:
                        self._controls.append(job)
            case _Discard(entry_ids):
                try:
                    self.store.delete(entry_ids)
                except TierStoreError:
                    logger.warning(
                        "kv tier: discarding %d unreadable entries failed", len(entry_ids)
                    )
            case _SetBudget(owner, budget):
                try:
                    self._count_evictions(self.store.set_budget(owner, budget))
                except TierStoreError:
                    logger.warning("kv tier: setting %r's budget failed", owner)

    def _store(self, job: _Offload) -> None:
        block = job.block
        with self._cond:
            forgotten = block.owner in self._forgotten
        if forgotten:  # taken off the queue just before forget_owner looked at it
            self._drop(block.owner, "forgotten")
            return
        block_id = job.block_id
        try:
            if self.store.contains([block_id])[0]:
                self.store.touch([block_id], [job.value])
                with self._counters_lock:
                    self._tally(block.owner).present += 1
                return
            kv_bytes = job.kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            sealed = seal(job.seal_key, self.root, block.key, block_plaintext(block, kv_bytes))
            outcome = self.store.put(block_id, block.owner, sealed, job.value)
        except TierStoreError:
            self._drop(block.owner, "error")
            return
        if not isinstance(outcome, PutPlan):
            self._drop(block.owner, outcome.reason)
            return
        self._count_evictions(outcome.evictions)
        with self._counters_lock:
            counters = self._tally(block.owner)
            counters.offloads += 1
            counters.offloaded_bytes += len(sealed)

    # -- entry ids ------------------------------------------------------------------------------

    def _ids_of(self, keys: Sequence[BlockHash], seal_keys: Sequence[SealKey]) -> list[bytes]:
        """The entry ids of these blocks under these data keys, remembered for `discard`."""
        ids = entry_ids(self.root, keys, seal_keys)
        with self._ids_lock:
            for key, block_id in zip(keys, ids, strict=True):
                known = self._ids.pop(key, ())
                # A public block may be held under several prefixes' keys: keep each id.
                self._ids[key] = known if block_id in known else (*known, block_id)
            while len(self._ids) > self.remembered_blocks:
                self._ids.popitem(last=False)
        return ids

    # -- counting -------------------------------------------------------------------------------

    def _tally(self, owner: Owner) -> TierCounters:
        """The owner's counters, to add to (the caller holds `_counters_lock`)."""
        counters = self._counters.get(owner)
        if counters is None:
            counters = self._counters[owner] = TierCounters()
        return counters

    def _drop(self, owner: Owner, reason: DropReason) -> None:
        with self._counters_lock:
            self._tally(owner).drops[reason] += 1

    def _count_evictions(self, evictions: Sequence[Eviction]) -> None:
        with self._counters_lock:
            for eviction in evictions:
                counters = self._tally(eviction.owner)
                if eviction.cause == "own":
                    counters.evicted_own += 1
                else:
                    counters.evicted_pressure += 1
