"""The two limit stores keep the same contract (gateway/limits/store.py): windows that never
let more than the limit through in any minute, slots that are held until released (or, in
Redis, until their lease lapses), tokens charged up front and refunded. Redis is the real
server; the window is shortened so that tests can watch it slide."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.limits.process_store import ProcessLimits
from gateway.limits.redis_store import RedisLimits
from gateway.limits.store import HeldLease, Limits, LimitStore, Refusal
from tests.support.redis import drop_prefix

pytestmark = pytest.mark.anyio
WINDOW_S = 1.0  # a short window for the tests that watch it slide
LIMITS = Limits(requests_per_minute=5, tokens_per_minute=100, max_concurrent=3)

StoreFactory = Callable[..., LimitStore]


@pytest.fixture(params=["process", "redis"])
def make_store(
    request: pytest.FixtureRequest,
) -> StoreFactory:
    """Builds a store of the parametrized kind (both kinds share a key prefix per test)."""
    if request.param == "process":
        return lambda window_s=WINDOW_S, lease_s=15.0: ProcessLimits(window_s=window_s)
    url: str = request.getfixturevalue("redis_server")
    prefix: str = request.getfixturevalue("redis_prefix")
    return lambda window_s=WINDOW_S, lease_s=15.0: RedisLimits(
        url, prefix, timeout_s=2.0, lease_s=lease_s, window_s=window_s
    )


@pytest.fixture
async def store(make_store: StoreFactory) -> AsyncIterator[LimitStore]:
    opened = make_store()
    yield opened
    await opened.close()


def lease() -> str:
    return uuid.uuid4().hex


async def test_slots_are_held_until_released(store: LimitStore) -> None:
    held = [lease() for _ in range(3)]
    for lease_id in held:
        assert (await store.enter("t", lease_id, LIMITS)).allowed
    refused = await store.enter("t", lease(), LIMITS)
    assert refused.refusal is Refusal.CONCURRENCY and refused.retry_after_s == 1.0
    await store.release("t", held[0], 1, 0)
    assert (await store.enter("t", lease(), LIMITS)).allowed


async def test_each_tenant_has_its_own_limits(store: LimitStore) -> None:
    for _ in range(3):
        assert (await store.enter("a", lease(), LIMITS)).allowed
    assert not (await store.enter("a", lease(), LIMITS)).allowed
    assert (await store.enter("b", lease(), LIMITS)).allowed


async def test_no_more_requests_than_the_limit_in_a_window(store: LimitStore) -> None:
    limits = Limits(requests_per_minute=5, tokens_per_minute=100, max_concurrent=100)
    started = time.monotonic()
    for _ in range(5):
        assert (await store.enter("t", lease(), limits)).allowed
    refused = await store.enter("t", lease(), limits)
    assert refused.refusal is Refusal.REQUESTS
    assert refused.usage.requests_used == 5
    # The oldest entry leaves the window first: that is the wait.
    assert 0 < refused.retry_after_s <= WINDOW_S - (time.monotonic() - started) + 0.05
    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert (await store.enter("t", lease(), limits)).allowed


async def test_a_counted_request_takes_one_of_the_window_and_no_slot(store: LimitStore) -> None:
    limits = Limits(requests_per_minute=4, tokens_per_minute=100, max_concurrent=1)
    for used in (1, 2):
        counted = await store.count("t", lease(), limits)
        assert counted.allowed and counted.usage.requests_used == used
    assert (await store.enter("t", lease(), limits)).allowed  # the one slot was still free
    assert (await store.count("t", lease(), limits)).allowed  # and is not needed to count
    refused = await store.count("t", lease(), limits)
    assert refused.refusal is Refusal.REQUESTS and refused.usage.requests_used == 4
    assert 0 < refused.retry_after_s <= WINDOW_S


async def test_tokens_are_charged_up_front_and_refunded(store: LimitStore) -> None:
    first, second = lease(), lease()
    assert (await store.enter("t", first, LIMITS)).allowed
    charged = await store.charge("t", first, 60, 0, LIMITS)
    assert charged.allowed and charged.usage.tokens_used == 60
    assert (await store.enter("t", second, LIMITS)).allowed
    refused = await store.charge("t", second, 50, 0, LIMITS)
    assert refused.refusal is Refusal.TOKENS and 0 < refused.retry_after_s <= WINDOW_S
    await store.release("t", first, 1, 30)  # it used 30 of its 60
    allowed = await store.charge("t", second, 50, 0, LIMITS)
    assert allowed.allowed and allowed.usage.tokens_used == 80
    third = lease()
    assert (await store.enter("t", third, LIMITS)).allowed
    exactly = await store.charge("t", third, 20, 0, LIMITS)  # up to the limit, not past it
    assert exactly.allowed and exactly.usage.tokens_used == 100


async def test_each_choice_past_the_first_takes_a_slot(store: LimitStore) -> None:
    first = lease()
    assert (await store.enter("t", first, LIMITS)).allowed
    assert (await store.charge("t", first, 1, 3, LIMITS)).refusal is Refusal.CONCURRENCY
    assert (await store.charge("t", first, 1, 2, LIMITS)).allowed  # 3 slots in all
    assert (await store.enter("t", lease(), LIMITS)).refusal is Refusal.CONCURRENCY
    await store.release("t", first, 3, 0)
    assert (await store.enter("t", lease(), LIMITS)).allowed


async def test_a_lowered_limit_waits_for_enough_of_the_window_to_pass(store: LimitStore) -> None:
    generous = Limits(requests_per_minute=5, tokens_per_minute=100, max_concurrent=100)
    admitted = []
    for _ in range(4):
        assert (await store.enter("t", lease(), generous)).allowed
        admitted.append(time.monotonic())
        await asyncio.sleep(0.1)
    lowered = Limits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=100)
    refused = await store.enter("t", lease(), lowered)
    asked = time.monotonic()
    # Three of the four must leave before one more fits under 2: the wait is the third's.
    expected = admitted[2] + WINDOW_S - asked
    assert refused.refusal is Refusal.REQUESTS
    assert abs(refused.retry_after_s - expected) < 0.06, (refused.retry_after_s, expected)


async def test_a_limit_of_zero_refuses_for_a_whole_window(store: LimitStore) -> None:
    """An admin throttling a tenant to 0 while its window holds requests: a 429, never an
    error."""
    first = lease()
    assert (await store.enter("t", first, LIMITS)).allowed
    assert (await store.charge("t", first, 10, 0, LIMITS)).allowed
    stopped = Limits(requests_per_minute=0, tokens_per_minute=0, max_concurrent=3)
    refused = await store.enter("t", lease(), stopped)
    assert refused.refusal is Refusal.REQUESTS and refused.retry_after_s == WINDOW_S
    second = lease()
    assert (await store.enter("t", second, LIMITS)).allowed
    no_tokens = await store.charge("t", second, 1, 0, stopped)
    assert no_tokens.refusal is Refusal.TOKENS and no_tokens.retry_after_s == WINDOW_S


async def test_the_usage_says_when_the_window_is_empty_again(store: LimitStore) -> None:
    first = lease()
    verdict = await store.enter("t", first, LIMITS)
    assert verdict.usage.requests_used == 1
    assert 0.5 * WINDOW_S < verdict.usage.requests_reset_s <= WINDOW_S
    charged = await store.charge("t", first, 10, 0, LIMITS)
    assert charged.usage.tokens_used == 10 and 0 < charged.usage.tokens_reset_s <= WINDOW_S


async def test_two_gateways_share_one_redis_atomically(
    redis_server: str, redis_prefix: str
) -> None:
    """Sixty concurrent admissions from two stores (two gateways) on a tenant allowed ten
    at once: exactly ten get in."""
    gateways = [RedisLimits(redis_server, redis_prefix, timeout_s=2.0) for _ in range(2)]
    limits = Limits(requests_per_minute=1000, tokens_per_minute=10_000, max_concurrent=10)
    try:
        verdicts = await asyncio.gather(
            *(gateways[i % 2].enter("t", lease(), limits) for i in range(60))
        )
    finally:
        for gateway in gateways:
            await gateway.close()
    assert sum(verdict.allowed for verdict in verdicts) == 10


async def test_a_redis_lease_lapses_unless_renewed(redis_server: str, redis_prefix: str) -> None:
    store = RedisLimits(redis_server, redis_prefix, timeout_s=2.0, lease_s=2.0)
    limits = Limits(requests_per_minute=100, tokens_per_minute=100, max_concurrent=2)
    try:
        kept, lost = lease(), lease()
        assert (await store.enter("t", kept, limits)).allowed
        assert (await store.enter("t", lost, limits)).allowed
        assert not (await store.enter("t", lease(), limits)).allowed
        for _ in range(5):  # 2.5 s: past the lease, renewing only one of the two
            await asyncio.sleep(0.5)
            await store.renew([HeldLease("t", kept, 1)])
        assert (await store.enter("t", lease(), limits)).allowed  # the lapsed one's slot
        assert not (await store.enter("t", lease(), limits)).allowed  # the kept one holds
        await store.renew([HeldLease("t", lost, 1)])  # a lapsed lease is not brought back
        await store.release("t", kept, 1, 0)
        assert (await store.enter("t", lease(), limits)).allowed
    finally:
        await store.close()


# Limits an admin may set and change between any two steps (lowered ones included, and 0).
LIMIT_CHOICES = [
    Limits(requests_per_minute=8, tokens_per_minute=200, max_concurrent=3),
    Limits(requests_per_minute=3, tokens_per_minute=60, max_concurrent=2),
    Limits(requests_per_minute=0, tokens_per_minute=0, max_concurrent=0),
]
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["enter", "enter", "count", "charge", "charge", "release"]),
        st.sampled_from(["a", "b"]),
        st.integers(0, 6),  # which earlier admission (charge, release)
        st.integers(0, 80),  # tokens
        st.integers(0, 2),  # extra slots
        st.sampled_from([0, 0, 0, 1, 2]),  # which limits hold for this step
    ),
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS)
async def test_both_stores_give_the_same_answers(
    steps: list[tuple[str, str, int, int, int, int]], redis_server: str
) -> None:
    """Random admission sequences under limits that change between steps: the two stores
    refuse the same steps for the same reasons, with the same waits, and count the same usage
    (with a window no test outlasts)."""
    prefix = f"prefixgate-test-{uuid.uuid4().hex[:12]}"
    stores: list[LimitStore] = [
        ProcessLimits(window_s=600),
        RedisLimits(redis_server, prefix, timeout_s=2.0, window_s=600),
    ]
    try:
        # tenant, lease, slots, charged: an admission is charged once (the stores' contract)
        admitted: list[tuple[str, str, int, bool]] = []
        for step, tenant, which, tokens, extra, chosen in steps:
            limits = LIMIT_CHOICES[chosen]
            if step == "enter":
                lease_id = lease()
                answers = [await s.enter(tenant, lease_id, limits) for s in stores]
                if answers[0].allowed:
                    admitted.append((tenant, lease_id, 1, False))
            elif step == "count":
                lease_id = lease()
                answers = [await s.count(tenant, lease_id, limits) for s in stores]
            elif not admitted:
                continue
            elif step == "charge":
                index = which % len(admitted)
                tenant, lease_id, slots, charged = admitted[index]
                if charged:
                    continue
                answers = [await s.charge(tenant, lease_id, tokens, extra, limits) for s in stores]
                if answers[0].allowed:
                    admitted[index] = (tenant, lease_id, 1 + extra, True)
            else:
                tenant, lease_id, slots, _ = admitted.pop(which % len(admitted))
                for s in stores:
                    await s.release(tenant, lease_id, slots, tokens)
                continue
            ours, theirs = answers
            assert ours.refusal == theirs.refusal
            assert ours.usage.requests_used == theirs.usage.requests_used
            assert ours.usage.tokens_used == theirs.usage.tokens_used
            # Each on its own clock (monotonic here, Redis's there), moments apart.
            assert abs(ours.retry_after_s - theirs.retry_after_s) < 0.5
    finally:
        for s in stores:
            await s.close()
        drop_prefix(prefix)
