"""API-key authentication with a short in-memory cache.

Verified keys are remembered for `ttl` seconds, so the database is consulted at most once per
key per interval; when the database is briefly unreachable, a key verified within `stale_ttl`
keeps working, so a blip does not stop inference. Failures are never cached.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError
from tenancy import api_keys
from tenancy.api_keys import AuthFailure, VerifiedKey
from tenancy.db import is_outage
from tenancy.store import Store
from tenancy.tenants import get_tenant_by_id


@dataclass(frozen=True, slots=True)
class TenantSnapshot:
    """The tenant's settings as they were when its key was checked."""

    sharing_mode: str
    may_use_public_prefixes: bool
    cache_quota_blocks: int
    cache_reservation_blocks: int
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    scheduling_weight: float = 1.0  # its share of the engine's service against other tenants
    # Its bytes in a second KV tier (None: its pool quota's), and those reserved there.
    tier_quota_bytes: int | None = None
    tier_reservation_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: a tenant (by id) through one of its keys."""

    tenant_id: str
    tenant_slug: str
    key_id: str
    tenant: TenantSnapshot
    role: str = "inference"  # or "tenant-admin": such a key administers, it does not infer


class AuthenticationFailed(Exception):
    """A presented key was refused; `failure` says why (for the audit event, not the client)."""

    def __init__(self, failure: AuthFailure, key_id: str | None) -> None:
        super().__init__(failure.value)
        self.failure = failure
        self.key_id = key_id


class KeyAuthenticator:
    """Checks presented keys against the database, remembering the ones that passed."""

    def __init__(self, store: Store, ttl: float, stale_ttl: float) -> None:
        self._store = store
        self._ttl = ttl
        self._stale_ttl = stale_ttl
        self._cache: dict[str, tuple[Caller, float]] = {}
        self._generation = 0

    async def authenticate(self, presented: str) -> Caller:
        """The caller behind a presented key.

        Raises AuthenticationFailed for a refused key, and an `APIError` (503) when keys cannot
        be checked at all.
        """
        digest = hashlib.sha256(presented.encode()).hexdigest()
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and now - cached[1] < self._ttl:
            return cached[0]
        generation = self._generation
        try:
            result = await run_in_threadpool(self._lookup, presented)
        except Exception as error:
            if not is_outage(error):
                raise
            if cached is not None and now - cached[1] < self._stale_ttl:
                return cached[0]
            raise APIError.auth_unavailable() from error
        if isinstance(result, Caller):
            if generation == self._generation:  # no tenancy change arrived while we looked
                self._cache[digest] = (result, now)
            return result
        self._cache.pop(digest, None)
        failure, key_id = result
        raise AuthenticationFailed(failure, key_id)

    def forget_all(self) -> None:
        """Drop every remembered key check (tenancy changed somewhere)."""
        self._generation += 1  # a lookup already under way must not cache its stale answer
        self._cache.clear()

    def _lookup(self, presented: str) -> Caller | tuple[AuthFailure, str | None]:
        with self._store.transaction() as session:
            result = api_keys.authenticate(session, presented, self._store.key_secret)
            if not isinstance(result, VerifiedKey):
                return result, _key_id_of(presented)
            tenant = get_tenant_by_id(session, result.tenant_id)
            snapshot = TenantSnapshot(
                sharing_mode=tenant.sharing_mode,
                may_use_public_prefixes=tenant.may_use_public_prefixes,
                cache_quota_blocks=tenant.cache_quota_blocks,
                cache_reservation_blocks=tenant.cache_reservation_blocks,
                requests_per_minute=tenant.requests_per_minute,
                tokens_per_minute=tenant.tokens_per_minute,
                max_concurrent=tenant.max_concurrent,
                scheduling_weight=tenant.scheduling_weight,
                tier_quota_bytes=tenant.tier_quota_bytes,
                tier_reservation_bytes=tenant.tier_reservation_bytes or 0,
            )
            return Caller(
                str(result.tenant_id), result.tenant_slug, result.key_id, snapshot, result.role
            )


def _key_id_of(presented: str) -> str | None:
    parts = presented.split("_")
    return parts[1][:32] if len(parts) == 3 and parts[0] == "pgk" else None
