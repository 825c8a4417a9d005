"""A walk through the cache manager: public sharing, private isolation, quotas, zeroing.

No model runs here; the demo shows which prompt tokens each request could skip and what the
pool holds afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHasher
from engine.block_pool import BlockPool
from engine.budget import TenantBudget
from engine.cache_stats import CacheStats
from engine.kv_cache_manager import CacheRequest, KVCacheManager
from engine.kv_spec import KVSpec
from engine.scope import Public, Segment, Tenant, User


@dataclass(frozen=True, slots=True)
class DemoStep:
    description: str
    tenant_id: str
    prompt_tokens: int
    cached_tokens: int
    outcome: str


def run_demo(seed: int = 0) -> tuple[list[DemoStep], CacheStats]:
    """Serve a scripted multi-tenant workload through a small cache; returns steps and stats."""
    rng = random.Random(seed)
    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
    pool = BlockPool(spec, num_blocks=160)
    hasher = BlockHasher(spec.block_size)
    manager = KVCacheManager(pool, hasher, hasher.root("demo-model", "", "float32"))
    manager.set_budget("acme", TenantBudget(quota_blocks=96, reserved_blocks=32))
    manager.set_budget("globex", TenantBudget(quota_blocks=48))

    system = [rng.randrange(49_152) for _ in range(512)]
    conversation = [rng.randrange(49_152) for _ in range(300)]
    counter = iter(range(1_000_000))
    steps: list[DemoStep] = []

    def serve(description: str, tenant: str, user: str | None, tokens: list[int]) -> None:
        private = User(tenant, user) if user else Tenant(tenant)
        segments = [Segment(0, len(system), Public("default"))]
        segments.append(Segment(len(system), len(tokens), private))
        request = CacheRequest(f"demo-{next(counter)}", tenant, tokens, segments, private)
        hit = manager.match(request)
        refusal = manager.admit(hit, len(tokens) - hit.cached_tokens)
        if refusal is not None:
            steps.append(DemoStep(description, tenant, len(tokens), 0, f"refused: {refusal}"))
            return
        manager.commit(request.request_id, len(tokens))
        manager.free(request.request_id)
        manager.end_step()
        steps.append(DemoStep(description, tenant, len(tokens), hit.cached_tokens, "served"))

    for step in _script(system, conversation, rng):
        serve(*step)
    purged = manager.purge("globex")
    steps.append(DemoStep("purge tenant globex", "globex", 0, 0, f"{purged} blocks zeroed"))
    return steps, manager.stats()


def _script(
    system: list[int], conversation: list[int], rng: random.Random
) -> Iterator[tuple[str, str, str | None, list[int]]]:
    first_turn = system + conversation
    yield "acme/alice: first turn (cold)", "acme", "alice", first_turn
    yield "acme/alice: second turn", "acme", "alice", first_turn + [7] * 40
    yield "acme/bob: alice's words, another user", "acme", "bob", first_turn
    yield "globex/carol: same system prompt", "globex", "carol", system + [9] * 100
    yield "initech (tenant-wide): same system", "initech", None, system + [3] * 50
    noise = [rng.randrange(49_152) for _ in range(700)]
    yield "globex/carol: long private prompt", "globex", "carol", system + noise
