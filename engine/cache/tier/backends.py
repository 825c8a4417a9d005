"""A tier from settings: which store backs it, a worker's file or the store its workers share.

The facade (`kv_tier`) knows only the `TierStore` interface; this is the one place that knows
both backends, so the engine names a kind and its settings and gets a `KVTier`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from engine.cache.block_hash import BlockHash
from engine.cache.kv_spec import KVSpec
from engine.cache.tier.disk_store import DiskStore
from engine.cache.tier.entry import sealed_size_bound
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.redis_store import RedisStore
from engine.cache.tier.store import TierBudget, TierStore

TierKind = Literal["disk", "redis"]


def make_tier(
    kind: TierKind,
    *,
    spec: KVSpec,
    root: BlockHash,
    capacity_bytes: int,
    directory: Path | None = None,
    worker_name: str = "worker",
    redis_url: str | None = None,
    key_prefix: str = "prefixgate",
    default_budget: TierBudget | None = None,
    queue_blocks: int = 256,
) -> KVTier:
    """A tier from settings: a file `<directory>/<worker_name>.tier`, or a Redis store shared
    by every worker of the model under `key_prefix`."""
    store: TierStore
    if kind == "disk":
        if directory is None:
            raise ValueError("a disk tier needs a directory")
        store = DiskStore(
            directory / f"{worker_name}.tier",
            root,
            capacity_bytes,
            sealed_size_bound(spec),
            default_budget,
        )
    elif kind == "redis":
        if redis_url is None:
            raise ValueError("a redis tier needs a URL")
        store = RedisStore(redis_url, root, capacity_bytes, key_prefix, default_budget)
    else:
        raise ValueError(f"unknown tier kind {kind!r}")
    return KVTier(store, spec, root, queue_blocks=queue_blocks)
