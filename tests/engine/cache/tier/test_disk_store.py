"""The disk tier's file: private (0600 in a 0700 directory), one worker's alone, and kept
across a restart; a file of another model starts over, a damaged slot is dropped."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from engine.cache.tier.backends import make_tier
from engine.cache.tier.disk_store import FILE_HEADER_BYTES, DiskStore
from engine.cache.tier.entry import TierBlock, sealed_size_bound
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.store import PutPlan, TierBudget
from tests.engine.cache.tier.conftest import (
    HASHER,
    ROOT,
    SPEC,
    new_id,
    random_kv,
    seal_key,
    value_of,
)

CAPACITY = 64 * 4096


def open_disk(path: Path, root: bytes = ROOT) -> DiskStore:
    return DiskStore(path, root, CAPACITY, sealed_size_bound(SPEC))  # type: ignore[arg-type]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_file_is_0600_in_a_0700_directory(tmp_path: Path) -> None:
    previous = os.umask(0)  # the store's modes must not depend on the umask
    try:
        store = open_disk(tmp_path / "tiers" / "w.tier")
    finally:
        os.umask(previous)
    assert mode(tmp_path / "tiers") == 0o700
    assert mode(tmp_path / "tiers" / "w.tier") == 0o600
    store.close()


def test_existing_file_with_loose_mode_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "w.tier"
    path.write_bytes(b"")
    path.chmod(0o644)
    open_disk(path).close()
    assert mode(path) == 0o600


def test_second_worker_on_the_same_file_is_refused(tmp_path: Path) -> None:
    store = open_disk(tmp_path / "w.tier")
    with pytest.raises(RuntimeError, match="another worker"):
        open_disk(tmp_path / "w.tier")
    store.close()
    open_disk(tmp_path / "w.tier").close()  # free again once the first one closed


def test_reopened_file_keeps_entries_owners_and_priorities(tmp_path: Path) -> None:
    store = open_disk(tmp_path / "w.tier")
    entries = {new_id(): value_of() for _ in range(5)}
    for value, (entry_id, data) in enumerate(entries.items()):
        assert isinstance(store.put(entry_id, f"t{value % 2}", data, float(value)), PutPlan)
    usage = store.usage()
    store.close()
    reopened = open_disk(tmp_path / "w.tier")
    assert reopened.get_many(list(entries)) == list(entries.values())
    assert reopened.usage() == usage
    # The lowest-priority entry of t0 goes first when its quota shrinks to 2 entries.
    evictions = reopened.set_budget("t0", TierBudget(2 * reopened.slot_size))
    assert [e.victim.entry_id for e in evictions] == [next(iter(entries))]
    reopened.close()


def test_file_of_another_model_starts_over(tmp_path: Path) -> None:
    store = open_disk(tmp_path / "w.tier")
    entry_id = new_id()
    store.put(entry_id, "t1", value_of(), 1.0)
    store.close()
    other_root = HASHER.root("another-model", "", "bfloat16")
    reopened = open_disk(tmp_path / "w.tier", other_root)
    assert reopened.get_many([entry_id]) == [None] and reopened.usage() == {}
    reopened.close()


def test_damaged_slot_header_is_dropped_on_open(tmp_path: Path) -> None:
    store = open_disk(tmp_path / "w.tier")
    ids = [new_id() for _ in range(3)]
    for entry_id in ids:
        store.put(entry_id, "t1", value_of(), 1.0)
    slot_size = store.slot_size
    store.close()
    with open(tmp_path / "w.tier", "r+b") as file:  # one bit of the second slot's header
        file.seek(FILE_HEADER_BYTES + slot_size + 30)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0x01]))
    reopened = open_disk(tmp_path / "w.tier")
    assert sorted(reopened.contains(ids)) == [False, True, True]
    assert reopened.usage()["t1"].entries == 2
    reopened.close()


def test_restarted_worker_loads_what_it_offloaded_before(
    tmp_path: Path, tenant_blocks: list[TierBlock]
) -> None:
    key = seal_key()

    def start() -> KVTier:
        return make_tier(
            "disk", spec=SPEC, root=ROOT, capacity_bytes=CAPACITY, directory=tmp_path / "tier"
        )

    tier = start()
    kvs = [random_kv(i) for i in range(len(tenant_blocks))]
    for block, kv in zip(tenant_blocks, kvs, strict=True):
        assert tier.offload(block, key, kv, 1.0)
    tier.flush()
    tier.close()
    restarted = start()
    loaded = restarted.load(tenant_blocks, [key] * len(tenant_blocks))
    assert all(torch.equal(a, b) for a, b in zip(kvs, loaded, strict=True))  # type: ignore[arg-type]
    restarted.close()
