"""Both tier backends behind one fixture, on a tiny KV spec: a disk file in a temporary
directory and the real Redis server under the test's own key prefix."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.cache.block_hash import BlockHash, BlockHasher, block_token_bytes, encode_token_ids
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope, Tenant
from engine.cache.tier.disk_store import DiskStore, slot_size_for
from engine.cache.tier.entry import TierBlock, sealed_size_bound
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.redis_store import RedisStore
from engine.cache.tier.sealing import SealKey
from engine.cache.tier.store import TierBudget, TierStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=4)
HASHER = BlockHasher(SPEC.block_size)
ROOT = HASHER.root("tier-test-model", "", "bfloat16")

# Every value the store tests put is this long: one "entry" of capacity and budgets.
VALUE_BYTES = 600


class Backend:
    """Opens stores of one backend; the stores one test opens share one file (disk: the same
    worker reopened) or one key prefix (redis: several workers)."""

    def __init__(self, kind: str, tmp_path: Path, url: str = "", prefix: str = "") -> None:
        self.kind = kind
        self.path = tmp_path / "tier" / "worker.tier"
        self.url = url
        self.prefix = prefix
        self.opened: list[TierStore] = []
        # What one `VALUE_BYTES` value costs against budgets and capacity.
        self.entry_bytes = slot_size_for(sealed_size_bound(SPEC)) if kind == "disk" else VALUE_BYTES

    def open(
        self,
        entries: int = 1000,
        default_budget: TierBudget | None = None,
        root: BlockHash = ROOT,
        capacity_bytes: int | None = None,
    ) -> TierStore:
        """A store with room for `entries` values of `VALUE_BYTES` (or `capacity_bytes`)."""
        store: TierStore
        capacity = entries * self.entry_bytes if capacity_bytes is None else capacity_bytes
        if self.kind == "disk":
            bound = sealed_size_bound(SPEC)
            store = DiskStore(self.path, root, capacity, bound, default_budget)
        else:
            store = RedisStore(self.url, root, capacity, self.prefix, default_budget)
        self.opened.append(store)
        return store

    def charge(self, size: int) -> int:
        """What a value of `size` bytes costs in this backend's stores."""
        return self.entry_bytes if self.kind == "disk" else size

    def budget(self, quota_entries: int, reserved_entries: int = 0) -> TierBudget:
        return TierBudget(quota_entries * self.entry_bytes, reserved_entries * self.entry_bytes)

    def close_all(self) -> None:
        for store in self.opened:
            store.close()


@pytest.fixture(params=["disk", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each test using this runs on the disk store and on the Redis store."""
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_server")
        opened = Backend("redis", tmp_path, url, request.getfixturevalue("redis_prefix"))
    else:
        opened = Backend("disk", tmp_path)
    yield opened
    opened.close_all()


def value_of(size: int = VALUE_BYTES) -> bytes:
    """Random bytes standing in for a sealed value."""
    return os.urandom(size)


def new_id() -> bytes:
    return os.urandom(16)


def seal_key(key_id: str = "key-1") -> SealKey:
    return SealKey(key_id, os.urandom(32))


def blocks_of(tokens: list[int], scope: CacheScope, owner: str) -> list[TierBlock]:
    """The full blocks of a prompt under one scope, as the engine would offload them."""
    token_bytes = encode_token_ids(tokens)
    keys = HASHER.chain(ROOT, token_bytes, [scope] * (len(tokens) // SPEC.block_size))
    return [
        TierBlock(
            key,
            keys[index - 1] if index else ROOT,
            scope,
            block_token_bytes(token_bytes, index, SPEC.block_size),
            owner,
        )
        for index, key in enumerate(keys)
    ]


def random_kv(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_layers, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=generator).to(SPEC.dtype)


@pytest.fixture
def tenant_blocks() -> list[TierBlock]:
    return blocks_of(list(range(100, 116)), Tenant("t1"), "t1")


def open_tier(backend: Backend, entries: int = 1000, queue_blocks: int = 256) -> KVTier:
    return KVTier(backend.open(entries), SPEC, ROOT, queue_blocks=queue_blocks)
