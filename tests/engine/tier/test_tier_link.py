"""The cache manager with a second tier attached: what a failed request computed, and a
withdrawn public prefix, leave the tier too; a tier read back before a drop is not used after."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cache.cache_request import CacheRequest, KeyChain, SealKeys
from engine.cache.kv_cache_manager import KVCacheManager
from engine.cache.scope import Public, Segment, User
from engine.cache.tier.backends import make_tier
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.sealing import SealKey
from engine.cache.tier.speed import TierSpeed
from engine.cache.tier_link import TierLink
from tests.support.cache import make_manager, request, run_prompt

KEYS = SealKeys(SealKey("t1", os.urandom(32)), SealKey("prefix", os.urandom(32)))
PROMPT = list(range(1, 18))  # 4 full blocks of 4 before the last token
# Reading back is always the cheaper way here: the rule under test is what may be read.
FREE_READS = TierSpeed(latency_ms=0.0, bytes_per_s=1e15)


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[KVCacheManager, KVTier]]:
    manager = make_manager(num_blocks=32)
    tier = make_tier(
        "disk",
        spec=manager.pool.spec,
        root=manager.root,
        capacity_bytes=1 << 24,
        directory=tmp_path,
    )
    link = TierLink(tier, manager.pool, manager.root, lambda index: 1.0 + index)
    link.speed = FREE_READS
    manager.attach_tier(link)
    yield manager, tier
    tier.close()


def test_a_failed_requests_blocks_leave_the_tier_too(
    tiered: tuple[KVCacheManager, KVTier],
) -> None:
    manager, tier = tiered
    failed = dataclasses.replace(request("t1", PROMPT, User("t1", "u")), seal_keys=KEYS)
    run_prompt(manager, failed, free=False)  # committed, so queued for the tier
    keys = manager.prefix_cache.keys()
    assert len(keys) == 4
    manager.free(failed.request_id, keep_computed=False)
    tier.flush()
    assert tier.contains(keys, [KEYS.tenant] * 4) == [False] * 4


def test_a_dropped_public_prefix_leaves_the_tier_and_staged_copies_are_not_used(
    tiered: tuple[KVCacheManager, KVTier],
) -> None:
    manager, tier = tiered
    public = Public("default")

    def prompt_of(tenant: str) -> CacheRequest:
        segments = [Segment(0, 16, public), Segment(16, 17, User(tenant, "u"))]
        plain = request(tenant, PROMPT, User(tenant, "u"), segments=segments)
        return dataclasses.replace(plain, seal_keys=KEYS)

    run_prompt(manager, prompt_of("t1"))
    tier.flush()
    # Another worker over the same tier, whose pool never held the prefix, stages it for a
    # request that waits.
    other = make_manager(num_blocks=32)
    link = TierLink(tier, other.pool, other.root, lambda index: 1.0 + index)
    link.speed = FREE_READS
    other.attach_tier(link)
    waiting = prompt_of("t2")
    chain = KeyChain.of(waiting, other.block_size)
    assert other.match(waiting, chain).cached_tokens == 16
    assert len(chain.staged) == 4
    # The prefix is withdrawn before the request is admitted: neither the tier's copies nor
    # the staged ones serve it.
    other.drop_public("default", PROMPT[:16])
    tier.flush()
    assert other.match(waiting, chain).cached_tokens == 0
    assert not chain.staged
    assert tier.contains(chain.keys[:4], [KEYS.public] * 4) == [False] * 4
