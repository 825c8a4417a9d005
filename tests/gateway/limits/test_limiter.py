"""The limiter in front of the stores: leases renewed while requests run, and fail-open when
Redis does not answer (limits in this process, a log line, a metric; no request waits on a
Redis known to be away), back to Redis once it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import pytest
import redis

from gateway.auth.key_auth import Caller, TenantSnapshot
from gateway.errors import APIError
from gateway.limits.limiter import Limiter
from gateway.limits.redis_store import RedisLimits, redis_place
from gateway.limits.store import Limits
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.anyio


def caller(tenant_id: str = "t", max_concurrent: int = 2, requests_per_minute: int = 100) -> Caller:
    snapshot = TenantSnapshot(
        sharing_mode="user", may_use_public_prefixes=True, cache_quota_blocks=64,
        cache_reservation_blocks=0, requests_per_minute=requests_per_minute,
        tokens_per_minute=10_000, max_concurrent=max_concurrent,
    )  # fmt: skip
    return Caller(tenant_id, tenant_id, "key", snapshot)


@pytest.fixture
def proxy(redis_server: str) -> Iterator[TcpProxy]:
    parts = urlsplit(redis_server)
    started = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379).start()
    yield started
    started.stop()


@contextlib.asynccontextmanager
async def running(limiter: Limiter) -> AsyncIterator[Limiter]:
    keeper = asyncio.create_task(limiter.keep_leases())
    try:
        yield limiter
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await limiter.close()


def limiter_through(proxy: TcpProxy, prefix: str, lease_s: float = 15.0) -> Limiter:
    url = f"redis://127.0.0.1:{proxy.port}/0"
    store = RedisLimits(url, prefix, timeout_s=0.25, lease_s=lease_s)
    return Limiter(store, lease_s)


async def test_a_shared_limiter_counts_every_gateway_once(
    redis_server: str, redis_prefix: str
) -> None:
    gateways = [Limiter(RedisLimits(redis_server, redis_prefix, timeout_s=2.0)) for _ in range(2)]
    one, other = gateways
    first = one.admission(caller())
    await first.enter()
    await other.admission(caller()).enter()
    third = other.admission(caller())
    with pytest.raises(APIError) as refused:
        await third.enter()
    assert refused.value.status == 429 and "concurrent" in refused.value.message
    assert third.headers()  # a refusal still tells the client where it stands
    first.release(0)
    await one.drain()  # the release goes out on a task of its own
    await third.enter()
    for gateway in gateways:
        await gateway.close()


async def test_redis_away_means_limits_in_this_process_until_it_answers(
    proxy: TcpProxy, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "gateway.limits.limiter")
    async with running(limiter_through(proxy, redis_prefix)) as limiter:
        admitted = limiter.admission(caller(max_concurrent=1))
        await admitted.enter()
        assert limiter.mode == "redis"
        proxy.stop()
        away = limiter.admission(caller("u", max_concurrent=1))
        await away.enter()  # not refused, not an error: counted here
        assert limiter.mode == "process (redis away)" and limiter.fallbacks == 1
        assert away.store is limiter.local
        waits = []
        for _ in range(5):  # none of these waits on the Redis known to be away
            started = time.perf_counter()
            admission = limiter.admission(caller("v", max_concurrent=10))
            await admission.enter()
            admission.release(0)
            waits.append(time.perf_counter() - started)
        assert max(waits) < 0.05, waits
        refused = limiter.admission(caller("u", max_concurrent=1))  # limited here, all the same
        with pytest.raises(APIError):
            await refused.enter()
        admitted.release(0)  # entered in Redis: its release is lost, its lease lapses
        warnings = [r for r in caplog.records if "did not answer" in r.getMessage()]
        assert len(warnings) == 1 and "fail-open" in warnings[0].getMessage()
        proxy.start()
        deadline = time.monotonic() + 5
        while limiter.mode != "redis":
            assert time.monotonic() < deadline, "the probe never found Redis again"
            await asyncio.sleep(0.1)
        back = limiter.admission(caller("w"))
        await back.enter()
        assert back.store is limiter.shared
        assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_a_hung_redis_costs_one_timeout_not_one_per_request(redis_prefix: str) -> None:
    """A Redis that accepts connections and never answers (a hung machine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    limiter = Limiter(RedisLimits(url, redis_prefix, timeout_s=0.25))
    try:
        started = time.perf_counter()
        await limiter.admission(caller()).enter()
        first = time.perf_counter() - started
        started = time.perf_counter()
        await limiter.admission(caller()).enter()
        second = time.perf_counter() - started
        assert 0.2 <= first < 1.0, first
        assert second < 0.05, second
    finally:
        stop.set()
        for sock in accepted:
            sock.close()
        listener.close()
        await limiter.close()


async def test_running_requests_keep_their_slots_past_the_lease(
    redis_server: str, redis_prefix: str
) -> None:
    lease_s = 1.0
    store = RedisLimits(redis_server, redis_prefix, timeout_s=2.0, lease_s=lease_s)
    async with running(Limiter(store, lease_s)) as limiter:
        held = limiter.admission(caller(max_concurrent=1))
        await held.enter()
        await asyncio.sleep(2.5 * lease_s)  # renewed every third of a lease meanwhile
        other = RedisLimits(redis_server, redis_prefix, timeout_s=2.0, lease_s=lease_s)
        one_slot = Limits(requests_per_minute=100, tokens_per_minute=100, max_concurrent=1)
        assert not (await other.enter("t", "other-gateway", one_slot)).allowed
        held.release(0)
        await limiter.drain()
        assert (await other.enter("t", "other-gateway", one_slot)).allowed
        await other.close()


async def test_without_redis_limits_are_this_processs_own() -> None:
    limiter = Limiter()
    assert limiter.mode == "process"
    admission = limiter.admission(caller(max_concurrent=1))
    await admission.enter()
    assert admission.store is limiter.local and limiter.fallbacks == 0
    await limiter.close()


async def test_an_error_answered_by_redis_is_no_outage(
    redis_server: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A step whose script fails (here: a tenant's key of the wrong type) is counted in this
    process; Redis stays in use for everyone else, and the error is logged once."""
    caplog.set_level(logging.ERROR, "gateway.limits.limiter")
    broken = redis.Redis.from_url(redis_server)
    broken.set(f"{redis_prefix}:{{broken}}:requests", "not a sorted set")
    broken.close()
    limiter = Limiter(RedisLimits(redis_server, redis_prefix, timeout_s=2.0))
    for _ in range(3):
        admission = limiter.admission(caller("broken", max_concurrent=5))
        await admission.enter()
        assert admission.store is limiter.local
    assert limiter.mode == "redis"  # not an outage: nobody else falls back
    healthy = limiter.admission(caller("healthy"))
    await healthy.enter()
    assert healthy.store is limiter.shared
    errors = [r for r in caplog.records if "answered with an error" in r.getMessage()]
    assert len(errors) == 1 and "WRONGTYPE" in errors[0].getMessage()
    await limiter.close()


def test_a_redis_url_is_shown_without_its_password() -> None:
    assert redis_place("redis://:s3cret@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert redis_place("rediss://user:s3cret@cache.internal/1") == "rediss://cache.internal:6379/1"
    assert redis_place("redis://cache.internal?password=s3cret&db=3") == (
        "redis://cache.internal:6379/3"
    )
    assert redis_place("redis://[::1]:6379") == "redis://[::1]:6379/0"
    assert redis_place("unix:///run/redis.sock?db=1&password=x") == "unix:///run/redis.sock?db=1"
