"""The shared limit store: each tenant's windows and slots in Redis, for every gateway at once.

Each admission step is one call of one Lua script (limits.lua), so it is atomic and costs one
round trip: no gateway can read a count that another is about to change. All of a tenant's
keys carry its id as a hash tag (`prefixgate:{<tenant id>}:...`), so they live in one slot of
a Redis Cluster too. Times are Redis's own, so gateways with skewed clocks agree.

Slots are leases of `lease_s`: a gateway renews those of its running requests every third of
it (`renew`, one pipelined round trip for all), so a gateway that dies gives its tenants their
slots back within one lease. Redis keeps nothing that must survive it: after a restart every
tenant starts with empty windows and no slots held.

Every call has a short timeout and no retries; one that fails raises `LimitStoreDown`, and the
limiter falls back to its in-process store (limiter.py says why).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from gateway.limits.store import (
    WINDOW_S,
    HeldLease,
    Limits,
    LimitStoreDown,
    LimitStoreFailed,
    Refusal,
    Verdict,
    WindowUsage,
    window_wait,
)

_SCRIPT = files("gateway.limits").joinpath("limits.lua").read_text()
_REFUSALS = {0: None, 1: Refusal.CONCURRENCY, 2: Refusal.REQUESTS, 3: Refusal.TOKENS}


class RedisLimits:
    """Limits kept in Redis (`LimitStore`), shared by every gateway that uses the same URL
    and key prefix."""

    name = "redis"

    def __init__(
        self,
        url: str,
        key_prefix: str = "prefixgate",
        timeout_s: float = 0.25,
        lease_s: float = 15.0,
        window_s: float = WINDOW_S,
    ) -> None:
        self._client: Redis = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # a slow answer is a missing one: fall back at once
            decode_responses=False,
        )
        self._script = self._client.register_script(_SCRIPT)
        self.where = redis_place(url)
        self._prefix = key_prefix
        self.lease_s = lease_s
        self._window_ms = int(window_s * 1000)

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self._prefix}:{{{tenant_id}}}"
        return [
            f"{base}:requests",
            f"{base}:token-times",
            f"{base}:token-counts",
            f"{base}:token-sum",
            f"{base}:slots",
        ]

    async def _run(self, tenant_id: str, step: str, lease_id: str, *args: int) -> Any:
        try:
            return await self._script(
                keys=self._keys(tenant_id), args=[step, self._window_ms, lease_id, *args]
            )
        except ResponseError as error:  # it answered: no outage, an error of the script's
            raise LimitStoreFailed(str(error)) from error
        except (RedisError, OSError) as error:
            raise LimitStoreDown(f"{type(error).__name__}: {error}") from error

    async def enter(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        reply = await self._run(
            tenant_id,
            "enter",
            lease_id,
            limits.requests_per_minute,
            limits.max_concurrent,
            self._lease_ms,
        )
        return self._verdict(reply, 1, limits.requests_per_minute)

    async def count(self, tenant_id: str, lease_id: str, limits: Limits) -> Verdict:
        reply = await self._run(tenant_id, "count", lease_id, limits.requests_per_minute)
        return self._verdict(reply, 1, limits.requests_per_minute)

    async def charge(
        self, tenant_id: str, lease_id: str, tokens: int, extra_slots: int, limits: Limits
    ) -> Verdict:
        reply = await self._run(
            tenant_id,
            "charge",
            lease_id,
            tokens,
            extra_slots,
            limits.max_concurrent,
            limits.tokens_per_minute,
            self._lease_ms,
        )
        return self._verdict(reply, tokens, limits.tokens_per_minute)

    async def release(self, tenant_id: str, lease_id: str, slots: int, refund: int) -> None:
        await self._run(tenant_id, "release", lease_id, slots, refund)

    async def renew(self, leases: Sequence[HeldLease]) -> None:
        """Every lease in one round trip: one script call per tenant, pipelined."""
        by_tenant: dict[str, list[HeldLease]] = defaultdict(list)
        for lease in leases:
            by_tenant[lease.tenant_id].append(lease)
        if not by_tenant:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for tenant_id, held in by_tenant.items():
                    pairs: list[str | int] = []
                    for lease in held:
                        pairs += [lease.lease_id, lease.slots]
                    await self._script(
                        keys=self._keys(tenant_id),
                        args=["renew", self._window_ms, "", self._lease_ms, *pairs],
                        client=pipe,
                    )
                await pipe.execute()
        except (RedisError, OSError) as error:
            raise LimitStoreDown(f"{type(error).__name__}: {error}") from error

    def _verdict(self, reply: list[Any], wanted: int, limit: int) -> Verdict:
        """A script's answer as a `Verdict`. A window's refusal comes with the window's entries
        (time, amount), oldest first; the wait is worked out from them here, by the rule the
        in-process store keeps too (`window_wait`)."""
        refusal = _REFUSALS[int(reply[0])]
        usage = WindowUsage(
            requests_used=int(reply[2]),
            requests_reset_s=int(reply[3]) / 1000,
            tokens_used=int(reply[4]),
            tokens_reset_s=int(reply[5]) / 1000,
        )
        wait = int(reply[1]) / 1000
        if refusal in (Refusal.REQUESTS, Refusal.TOKENS):
            now, raw = int(reply[7]) / 1000, reply[8:]
            entries = [(int(raw[i]) / 1000, int(raw[i + 1])) for i in range(0, len(raw), 2)]
            used = usage.requests_used if refusal is Refusal.REQUESTS else usage.tokens_used
            wait = window_wait(entries, used, wanted, limit, now, self._window_ms / 1000)
        return Verdict(usage, refusal, wait)

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as error:
            raise LimitStoreDown(f"{type(error).__name__}: {error}") from error

    async def close(self) -> None:
        await self._client.aclose()

    @property
    def _lease_ms(self) -> int:
        return int(self.lease_s * 1000)


def redis_place(url: str) -> str:
    """Where a Redis URL points, without its credentials: `redis://host:port/db`, or
    `unix:///path?db=N` for a socket (a password in the user part or the query is left out)."""
    parts = urlsplit(url)
    database = parse_qs(parts.query).get("db", ["0"])[0]
    if parts.scheme == "unix":
        return f"unix://{parts.path}?db={database}"
    database = parts.path.strip("/") or database
    host = parts.hostname or "localhost"
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}:{parts.port or 6379}/{database}"
