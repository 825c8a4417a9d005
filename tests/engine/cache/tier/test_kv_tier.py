"""KVTier end to end on both stores: what is offloaded comes back bit for bit; tampered,
swapped, replayed or colliding values are misses counted by reason, never data; forgetting an
owner drops its offloads and deletes its entries; calibration measures something real."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.scope import Public
from engine.cache.tier.counters import MissReason
from engine.cache.tier.entry import TierBlock, block_plaintext, entry_id
from engine.cache.tier.kv_tier import KVTier, TierSpeed
from engine.cache.tier.sealing import SealKey, seal_overhead
from engine.cache.tier.store import PutPlan, Refused, TierBudget, TierStore
from tests.engine.cache.tier.conftest import (
    ROOT,
    SPEC,
    Backend,
    blocks_of,
    open_tier,
    random_kv,
    seal_key,
)

KEY = seal_key("tenant-t1/1")


def offload_all(tier: KVTier, blocks: Sequence[TierBlock], seed: int = 0) -> list[torch.Tensor]:
    kvs = [random_kv(seed + i) for i in range(len(blocks))]
    for block, kv in zip(blocks, kvs, strict=True):
        assert tier.offload(block, KEY, kv, 1.0)
    tier.flush()
    return kvs


def stored(tier: KVTier, block: TierBlock) -> bytes:
    value = tier.store.get_many([entry_id(KEY, ROOT, block.key)])[0]
    assert value is not None
    return value


def overwrite(tier: KVTier, block: TierBlock, value: bytes, key: SealKey = KEY) -> None:
    """Write `value` as `block`'s entry under `key`, as anyone with write access to the store
    who knew the entry's id could (the id is the one a reader holding `key` looks up)."""
    block_id = entry_id(key, ROOT, block.key)
    assert isinstance(tier.store.put(block_id, block.owner, value, 1.0), PutPlan)


def held(tier: KVTier, blocks: Sequence[TierBlock], key: SealKey = KEY) -> list[bool]:
    return tier.contains([block.key for block in blocks], [key] * len(blocks))


def misses(tier: KVTier, owner: Owner) -> dict[MissReason, int]:
    return dict(tier.stats().owners[owner].counters.misses)


def test_offloaded_blocks_load_back_identical(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    kvs = offload_all(tier, tenant_blocks)
    assert held(tier, tenant_blocks) == [True] * len(tenant_blocks)
    loaded = tier.load(tenant_blocks, [KEY] * len(tenant_blocks))
    for kv, back in zip(kvs, loaded, strict=True):
        assert back is not None and back.dtype == SPEC.dtype
        assert torch.equal(back, kv)
    counters = tier.stats().owners["t1"].counters
    assert (counters.offloads, counters.loads, counters.missed) == (4, 4, 0)
    assert counters.loaded_bytes == 4 * SPEC.bytes_per_block
    tier.close()


def test_tampered_value_is_a_tag_miss(backend: Backend, tenant_blocks: list[TierBlock]) -> None:
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks)
    value = bytearray(stored(tier, tenant_blocks[1]))
    value[len(value) // 2] ^= 0x01
    overwrite(tier, tenant_blocks[1], bytes(value))
    loaded = tier.load(tenant_blocks, [KEY] * 4)
    assert [kv is None for kv in loaded] == [False, True, False, False]
    assert misses(tier, "t1") == {"tag": 1}
    tier.close()


def test_value_swapped_onto_another_entry_is_a_tag_miss(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks)
    overwrite(tier, tenant_blocks[2], stored(tier, tenant_blocks[0]))
    assert tier.load([tenant_blocks[2]], [KEY]) == [None]
    assert misses(tier, "t1") == {"tag": 1}
    tier.close()


def test_replayed_value_under_an_old_key_is_a_key_miss(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    """The tenant's data key changed (say, deleted and issued again): a value sealed under
    the old one, written back, never opens under the new one."""
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks)  # under KEY
    old_value = stored(tier, tenant_blocks[0])
    newer = seal_key("tenant-t1/2")
    assert tier.offload(tenant_blocks[0], newer, random_kv(9), 1.0)
    tier.flush()
    assert tier.load([tenant_blocks[0]], [newer])[0] is not None
    overwrite(tier, tenant_blocks[0], old_value, newer)
    assert tier.load([tenant_blocks[0]], [newer]) == [None]
    # The old key's id with another secret names no entry, and the old value copied onto
    # the entry that secret would look up opens nothing either.
    forged = seal_key(KEY.key_id)
    assert held(tier, tenant_blocks[:1], forged) == [False]
    overwrite(tier, tenant_blocks[0], old_value, forged)
    assert tier.load([tenant_blocks[0]], [forged]) == [None]
    assert misses(tier, "t1") == {"key": 1, "tag": 1}
    tier.close()


def test_value_of_another_identity_under_the_same_key_is_an_identity_miss(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    """A block key that collides (same key, other tokens or parent) is a miss (I3)."""
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks)
    block = tenant_blocks[1]
    other_tokens = TierBlock(block.key, block.parent_key, block.scope, bytes(16), "t1")
    other_parent = TierBlock(block.key, ROOT, block.scope, block.token_bytes, "t1")
    other_scope = TierBlock(block.key, block.parent_key, Public("ns"), block.token_bytes, "t1")
    assert tier.load([other_tokens, other_parent, other_scope], [KEY] * 3) == [None] * 3
    assert misses(tier, "t1") == {"identity": 3}
    tier.close()


def test_absent_and_keyless_blocks_are_misses(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks[:2])
    loaded = tier.load(tenant_blocks, [KEY, None, KEY, KEY])
    assert [kv is None for kv in loaded] == [False, True, True, True]
    assert misses(tier, "t1") == {"key": 1, "absent": 2}
    tier.close()


def test_offload_of_a_held_block_raises_its_priority_and_writes_nothing(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    kvs = offload_all(tier, tenant_blocks[:1])
    assert tier.offload(tenant_blocks[0], KEY, random_kv(99), 2.0)
    tier.flush()
    assert torch.equal(tier.load(tenant_blocks[:1], [KEY])[0], kvs[0])  # type: ignore[arg-type]
    counters = tier.stats().owners["t1"].counters
    assert (counters.offloads, counters.present) == (1, 1)
    tier.close()


def test_offload_of_a_wrong_shape_is_an_error(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    with pytest.raises(ValueError, match="CPU tensor"):
        tier.offload(tenant_blocks[0], KEY, random_kv(0).float(), 1.0)
    with pytest.raises(ValueError, match="CPU tensor"):
        tier.offload(tenant_blocks[0], KEY, random_kv(0)[:1], 1.0)
    tier.close()


class GatedStore:
    """A real store whose puts wait for a gate: the tier's worker stays busy meanwhile."""

    def __init__(self, store: TierStore) -> None:
        self.inner = store
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a put is at the gate
        self.kind = store.kind
        self.capacity_bytes = store.capacity_bytes

    def put(self, entry_id: bytes, owner: Owner, sealed: bytes, value: float) -> PutPlan | Refused:
        self.waiting.set()
        self.gate.wait(timeout=10)
        return self.inner.put(entry_id, owner, sealed, value)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_full_queue_drops_offloads_without_blocking(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    gated = GatedStore(backend.open())
    tier = KVTier(gated, SPEC, ROOT, queue_blocks=2)  # type: ignore[arg-type]
    assert tier.offload(tenant_blocks[0], KEY, random_kv(0), 1.0)
    assert gated.waiting.wait(timeout=5)  # the worker holds the first one
    start = time.perf_counter()
    accepted = [tier.offload(block, KEY, random_kv(1), 1.0) for block in tenant_blocks[1:]]
    assert time.perf_counter() - start < 1.0
    assert accepted == [True, True, False]
    gated.gate.set()
    tier.flush()
    counters = tier.stats().owners["t1"].counters
    assert counters.offloads == 3
    assert counters.drops == {"queue": 1}
    tier.close()


def test_forget_owner_drops_queued_offloads_refuses_new_ones_and_deletes_entries(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    gated = GatedStore(backend.open())
    tier = KVTier(gated, SPEC, ROOT)  # type: ignore[arg-type]
    public = blocks_of(list(range(16)), Public("ns"), PUBLIC_OWNER)  # type: ignore[arg-type]
    gated.gate.set()
    offload_all(tier, tenant_blocks[:2])
    offload_all(tier, public[:1])
    gated.gate.clear()
    gated.waiting.clear()
    assert tier.offload(tenant_blocks[2], KEY, random_kv(2), 1.0)
    assert gated.waiting.wait(timeout=5)  # being stored: it lands, and is purged after
    assert tier.offload(tenant_blocks[3], KEY, random_kv(3), 1.0)  # queued: dropped
    tier.forget_owner("t1")
    assert not tier.offload(tenant_blocks[0], KEY, random_kv(0), 1.0)  # refused
    gated.gate.set()
    tier.flush()
    assert held(tier, tenant_blocks) == [False] * 4
    assert held(tier, public[:1]) == [True]
    assert tier.load(tenant_blocks[:1], [KEY]) == [None]
    stats = tier.stats()
    counters = stats.owners["t1"].counters
    assert (stats.owners["t1"].entries, counters.offloads, counters.purged) == (0, 3, 3)
    assert counters.drops == {"forgotten": 2}
    with pytest.raises(ValueError, match="public"):
        tier.forget_owner(PUBLIC_OWNER)
    tier.close()


def test_shared_store_forget_deletes_entries_another_worker_wrote(
    redis_server: str, redis_prefix: str, tmp_path: object, tenant_blocks: list[TierBlock]
) -> None:
    backend = Backend("redis", tmp_path, redis_server, redis_prefix)  # type: ignore[arg-type]
    first, second = open_tier(backend), open_tier(backend)
    offload_all(first, tenant_blocks[:2])
    offload_all(second, tenant_blocks[2:], seed=2)
    assert held(second, tenant_blocks) == [True] * 4
    first.forget_owner("t1")
    first.flush()
    assert held(second, tenant_blocks) == [False] * 4
    # The other worker, not told yet, has its offloads refused by the shared store.
    assert second.offload(tenant_blocks[0], KEY, random_kv(0), 1.0)
    second.flush()
    assert held(second, tenant_blocks[:1]) == [False]
    assert second.stats().owners["t1"].counters.drops == {"forgotten": 1}
    first.close()
    second.close()


def test_evictions_are_counted_on_their_victims_by_cause(backend: Backend) -> None:
    t1 = blocks_of(list(range(12)), Public("x"), "t1")  # the scope is immaterial here
    t2 = blocks_of(list(range(1000, 1012)), Public("y"), "t2")
    sealed_bytes = len(block_plaintext(t1[0], bytes(SPEC.bytes_per_block)))
    charge = backend.charge(sealed_bytes + seal_overhead(KEY.key_id))
    tier = KVTier(backend.open(capacity_bytes=4 * charge), SPEC, ROOT)
    assert charge <= tier.bytes_per_entry < charge + 4096
    tier.set_budget("t1", TierBudget(2 * charge))
    for block in t1:  # the third goes over t1's quota: its lowest entry goes
        assert tier.offload(block, KEY, random_kv(0), 1.0)
    tier.flush()
    for block in t2:  # the third fills the store: the lowest entry above reservations goes
        assert tier.offload(block, KEY, random_kv(0), 1.0)
    tier.flush()
    stats = tier.stats()
    counters = {owner: stats.owners[owner].counters for owner in ("t1", "t2")}
    assert (counters["t1"].evicted_own, counters["t1"].evicted_pressure) == (1, 1)
    assert (counters["t2"].evicted_own, counters["t2"].evicted_pressure) == (0, 0)
    assert (stats.owners["t1"].entries, stats.owners["t2"].entries) == (1, 3)
    assert stats.used_bytes == stats.capacity_bytes == 4 * charge
    tier.close()


def test_refused_offload_is_counted_as_a_drop(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    tier.set_budget("t1", TierBudget(0))
    assert tier.offload(tenant_blocks[0], KEY, random_kv(0), 1.0)  # queued; refused later
    tier.flush()
    assert held(tier, tenant_blocks[:1]) == [False]
    assert tier.stats().owners["t1"].counters.drops == {"quota": 1}
    tier.close()


def test_hit_with_a_higher_value_keeps_a_block_over_newer_ones(backend: Backend) -> None:
    blocks = blocks_of(list(range(16)), Public("x"), "t1")
    sealed_bytes = len(block_plaintext(blocks[0], bytes(SPEC.bytes_per_block)))
    charge = backend.charge(sealed_bytes + seal_overhead(KEY.key_id))
    tier = KVTier(backend.open(capacity_bytes=3 * charge), SPEC, ROOT)
    for block, value in zip(blocks[:3], (0.5, 1.0, 1.0), strict=True):
        assert tier.offload(block, KEY, random_kv(0), value)  # the first is worth the least...
    tier.flush()
    assert tier.load(blocks[:1], [KEY], values=[10.0])[0] is not None  # ...until it is hit
    offload_all(tier, blocks[3:])  # the store is full: the lowest goes
    present = held(tier, blocks)
    assert present[0] and present[3] and sum(present) == 3
    tier.close()


def test_calibration_measures_positive_finite_speed_and_leaves_nothing(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks[:1])
    speed = tier.calibrate(samples=4)
    assert 0 < speed.latency_ms < math.inf and 0 < speed.bytes_per_s < math.inf
    assert speed.load_ms(SPEC.bytes_per_block) > speed.latency_ms
    assert set(tier.stats().owners) == {"t1"}
    assert held(tier, tenant_blocks[:1]) == [True]
    assert sum(u.entries for u in tier.store.usage().values()) == 1
    tier.close()


def test_loading_is_chosen_only_when_cheaper_than_recomputing() -> None:
    speed = TierSpeed(latency_ms=2.0, bytes_per_s=1e9)
    assert speed.load_ms(10**6) == pytest.approx(3.0)
    assert speed.cheaper_than(10**6, recompute_ms=3.5)
    assert not speed.cheaper_than(10**6, recompute_ms=2.9)


def test_speed_fit_goes_through_both_timings_and_never_makes_loads_free() -> None:
    speed = TierSpeed.fit(one_ms=1.5, many_ms=8.5, blocks=8, block_bytes=10**6)
    assert speed.load_ms(10**6) == pytest.approx(1.5)
    assert speed.load_ms(8 * 10**6) == pytest.approx(8.5)
    noisy = TierSpeed.fit(one_ms=2.0, many_ms=1.0, blocks=8, block_bytes=10**6)
    assert noisy.latency_ms > 0 and noisy.load_ms(8 * 10**6) > noisy.latency_ms


def test_a_chain_load_stops_at_its_first_miss_and_counts_only_what_it_returns(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    offload_all(tier, tenant_blocks)
    value = bytearray(stored(tier, tenant_blocks[1]))
    value[len(value) // 2] ^= 0x01
    overwrite(tier, tenant_blocks[1], bytes(value))
    loaded = tier.load(tenant_blocks, [KEY] * 4, chain=True)
    assert [kv is None for kv in loaded] == [False, True, True, True]
    counters = tier.stats().owners["t1"].counters
    assert (counters.loads, dict(counters.misses)) == (1, {"tag": 1})
    tier.close()


def test_an_unreadable_entry_is_discarded_so_the_next_offload_replaces_it(
    backend: Backend, tenant_blocks: list[TierBlock]
) -> None:
    tier = open_tier(backend)
    kvs = offload_all(tier, tenant_blocks)
    value = bytearray(stored(tier, tenant_blocks[0]))
    value[-1] ^= 0x01
    overwrite(tier, tenant_blocks[0], bytes(value))
    assert tier.load(tenant_blocks[:1], [KEY]) == [None]
    tier.flush()
    assert held(tier, tenant_blocks[:1]) == [False]
    tier.offload(tenant_blocks[0], KEY, kvs[0], 1.0)  # the block computed again
    tier.flush()
    again = tier.load(tenant_blocks[:1], [KEY])[0]
    assert again is not None and torch.equal(again, kvs[0])
    tier.close()
