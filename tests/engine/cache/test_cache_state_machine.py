"""I5 (and I2, I4 on the way) over random multi-tenant operation sequences, under each
eviction policy."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.cache.budget import (
    PUBLIC_OWNER,
    Owner,
    PoolExhausted,
    QuotaExceeded,
    ShareExceeded,
    TenantBudget,
)
from engine.cache.cache_request import CacheRequest, request_block_scopes
from engine.cache.eviction import EvictionPolicy
from engine.cache.scope import NO_CACHE, Public, Segment, Tenant, User
from tests.support.cache import make_manager

TENANTS = ("t1", "t2", "t3")
NUM_BLOCKS = 12
BLOCK_SIZE = 4
# A few shared beginnings so that requests really do hit each other's blocks.
FAMILIES = [[1] * 12, [2, 3] * 6, [7, 7, 8] * 4]


@dataclass
class Live:
    request: CacheRequest
    length: int  # tokens the request has (prompt + generated)
    computed: int


class CacheMachine(RuleBasedStateMachine):
    eviction: EvictionPolicy = "value"

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        self.manager.quotas.set_eviction(self.eviction)
        self.live: dict[str, Live] = {}
        self.counter = 0

    @initialize(public_quota=st.integers(4, NUM_BLOCKS))
    def set_public_budget(self, public_quota: int) -> None:
        self.manager.set_budget(PUBLIC_OWNER, TenantBudget(public_quota, public_quota // 4))

    @rule(
        tenant=st.sampled_from(TENANTS),
        user=st.sampled_from(["u1", "u2"]),
        family=st.integers(0, len(FAMILIES) - 1),
        shared=st.integers(0, 12),
        tail=st.lists(st.integers(0, 9), max_size=10),
        kind=st.sampled_from(["user", "tenant", "public", "none"]),
        chunk=st.integers(1, 16),
    )
    def admit(
        self,
        tenant: str,
        user: str,
        family: int,
        shared: int,
        tail: list[int],
        kind: str,
        chunk: int,
    ) -> None:
        tokens = FAMILIES[family][:shared] + tail
        if not tokens:
            return
        private = User(tenant, user) if kind != "tenant" else Tenant(tenant)
        if kind == "public" and shared:
            segments = [Segment(0, shared, Public("ns"))]
            if len(tokens) > shared:
                segments.append(Segment(shared, len(tokens), private))
        else:
            segments = [Segment(0, len(tokens), NO_CACHE if kind == "none" else private)]
        tail_scope = NO_CACHE if kind == "none" else private
        self.counter += 1
        request = CacheRequest(f"r{self.counter}", tenant, tokens, segments, tail_scope)
        hit = self.manager.match(request)
        planned = request_block_scopes(request, BLOCK_SIZE)
        for block, scope in zip(hit.blocks, planned, strict=False):
            assert block.scope == scope, "I2: a hit under another scope"
        new_tokens = min(chunk, len(tokens) - hit.cached_tokens)
        self._check_allocation(
            tenant, lambda: self.manager.admit(hit, new_tokens), public=kind == "public"
        )
        if request.request_id in self.manager._sequences:
            computed = hit.cached_tokens + new_tokens
            self.live[request.request_id] = Live(request, len(tokens), computed)
            self._write_kv(request.request_id, hit.cached_tokens)
            self.manager.commit(request.request_id, computed)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), generate=st.booleans())
    def step(self, data: st.DataObject, chunk: int, generate: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        live = self.live[request_id]
        if generate and live.computed >= live.length:
            self.manager.append_tokens(request_id, [5])
            live.length += 1
        target = min(live.length, live.computed + chunk)
        tenant = live.request.tenant_id
        refusal = self._check_allocation(
            tenant, lambda: self.manager.allocate(request_id, target), public=True
        )
        if refusal is None:
            self._write_kv(request_id, live.computed)
            live.computed = target
            self.manager.commit(request_id, target)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[request_id]
        self.manager.free(request_id)

    @rule(
        owner=st.sampled_from([*TENANTS, PUBLIC_OWNER]),
        quota=st.integers(0, NUM_BLOCKS),
        reserved=st.integers(0, NUM_BLOCKS),
    )
    def set_budget(self, owner: Owner, quota: int, reserved: int) -> None:
        try:
            self.manager.set_budget(owner, TenantBudget(quota, min(reserved, quota)))
        except ValueError as error:
            assert "reservations" in str(error)

    @rule(tenant=st.sampled_from(TENANTS))
    def purge(self, tenant: str) -> None:
        self.manager.purge(tenant)
        for block in self.manager.pool.blocks:
            if block.owner == tenant:
                assert block.key is None and block.ref_count > 0

    @rule()
    def end_step(self) -> None:
        self.manager.end_step()

    # -- helpers ------------------------------------------------------------------------------

    def _check_allocation(self, tenant: str, allocate, public: bool):  # type: ignore[no-untyped-def]
        pool = self.manager.pool
        owners = [*TENANTS, PUBLIC_OWNER]
        before = {owner: pool.owned(owner) for owner in owners}
        requesters = {tenant, PUBLIC_OWNER} if public else {tenant}
        refusal = allocate()
        after = {owner: pool.owned(owner) for owner in owners}
        if refusal is None:
            for owner in requesters:
                if after[owner] > before[owner]:
                    quota = self.manager.budget(owner).quota_blocks
                    assert after[owner] <= quota, f"I5: {owner} above its quota"
        else:
            assert isinstance(refusal, QuotaExceeded | ShareExceeded | PoolExhausted)
            assert after == before, "a refusal changed the pool"
            if isinstance(refusal, ShareExceeded):  # its own limit, never a crowded pool
                others = sum(
                    min(after[owner], self.manager.budget(owner).reserved_blocks)
                    for owner in owners
                    if owner != refusal.owner
                )
                assert refusal.share_blocks == pool.num_blocks - others
                assert refusal.active_blocks + refusal.needed_blocks > refusal.share_blocks
        for owner in owners:
            if owner not in requesters:
                reserved = self.manager.budget(owner).reserved_blocks
                assert after[owner] >= min(before[owner], reserved), "I5: reservation broken"
        return refusal

    def _write_kv(self, request_id: str, from_token: int) -> None:
        """Stand in for the forward pass: write non-zero KV into the request's new slots."""
        block_ids = self.manager.block_ids(request_id)
        for block_id in block_ids[from_token // BLOCK_SIZE :]:
            self.manager.pool.kv[:, :, block_id] = 1.0

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        self.manager.pool.check_consistency()

    @invariant()
    def each_owners_victim_ranks_lowest_among_its_idle_blocks(self) -> None:
        pool = self.manager.pool
        for owner in [*TENANTS, PUBLIC_OWNER]:
            idle = pool.idle_blocks(owner)
            victim = pool.victim(owner)
            if not idle:
                assert victim is None
                continue
            assert victim is not None and victim in idle
            assert pool.rank(victim) == min(pool.rank(block) for block in idle)
            if self.eviction == "lru":
                assert victim is idle[0], "lru: the least recently used goes first"

    @invariant()
    def ref_counts_match_live_requests(self) -> None:
        expected: dict[int, int] = {}
        for request_id in self.live:
            for block_id in self.manager.block_ids(request_id):
                expected[block_id] = expected.get(block_id, 0) + 1
        for block in self.manager.pool.blocks:
            assert block.ref_count == expected.get(block.block_id, 0)

    @invariant()
    def idle_cache_never_holds_an_owner_over_quota(self) -> None:
        pool = self.manager.pool
        for owner in [*TENANTS, PUBLIC_OWNER]:
            if pool.owned(owner) > self.manager.budget(owner).quota_blocks:
                assert pool.idle_count(owner) == 0, f"{owner} keeps cached blocks over quota"

    @invariant()
    def free_blocks_are_zero(self) -> None:
        pool = self.manager.pool
        free = list(pool._free)
        if free:
            assert bool((pool.kv[:, :, free] == 0).all()), "I4: a free block holds data"

    @invariant()
    def cached_blocks_are_indexed(self) -> None:
        for block in self.manager.pool.blocks:
            if block.key is not None:
                assert block.key in self.manager.prefix_cache


class LruCacheMachine(CacheMachine):
    eviction: EvictionPolicy = "lru"


MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachine.settings = MACHINE_SETTINGS
TestLruCacheStateMachine = LruCacheMachine.TestCase
TestLruCacheStateMachine.settings = MACHINE_SETTINGS
