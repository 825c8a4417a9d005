"""API-key authentication with a short in-memory cache.

Verified keys are remembered for `ttl` seconds, so the database is consulted at most once per
key per interval; when the database is briefly unreachable, a key verified within `stale_ttl`
keeps working, so a blip does not stop inference. Failures are never cached.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError
from tenancy import api_keys
from tenancy.api_keys import AuthFailure, KeyPrincipal
from tenancy.store import Store
from tenancy.tenants import get_tenant_by_id


@dataclass(frozen=True, slots=True)
class TenantSnapshot:
    sharing_mode: str
    may_use_public_prefixes: bool
    cache_quota_blocks: int
    cache_reservation_blocks: int
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request speaks for: a tenant (by id) through one of its keys."""

    tenant_id: str
    tenant_slug: str
    key_id: str
    role: str
    tenant: TenantSnapshot


class AuthenticationFailed(APIError):
    def __init__(self, failure: AuthFailure, key_id: str | None) -> None:
        if failure in (AuthFailure.TENANT_SUSPENDED, AuthFailure.TENANT_DELETED):
            super().__init__(403, "this tenant is suspended", "permission_error", None,
                             "tenant_suspended")  # fmt: skip
        else:
            super().__init__(401, "invalid API key", "authentication_error", None,
                             "invalid_api_key")  # fmt: skip
        self.failure = failure
        self.key_id = key_id


class KeyAuthenticator:
    def __init__(self, store: Store, ttl: float, stale_ttl: float) -> None:
        self._store = store
        self._ttl = ttl
        self._stale_ttl = stale_ttl
        self._cache: dict[str, tuple[Principal, float]] = {}

    async def authenticate(self, presented: str) -> Principal:
        """The principal for a presented key, or an `APIError` (401, 403 or 503)."""
        digest = hashlib.sha256(presented.encode()).hexdigest()
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and now - cached[1] < self._ttl:
            return cached[0]
        try:
            result = await run_in_threadpool(self._lookup, presented)
        except (OperationalError, DBAPIError) as error:
            if cached is not None and now - cached[1] < self._stale_ttl:
                return cached[0]
            raise APIError(503, "authentication is unavailable; retry shortly", "server_error",
                           None, "auth_unavailable", {"Retry-After": "5"}) from error  # fmt: skip
        if isinstance(result, Principal):
            self._cache[digest] = (result, now)
            return result
        self._cache.pop(digest, None)
        failure, key_id = result
        raise AuthenticationFailed(failure, key_id)

    def forget_all(self) -> None:
        """Drop every remembered key check (tenancy changed somewhere)."""
        self._cache.clear()

    def _lookup(self, presented: str) -> Principal | tuple[AuthFailure, str | None]:
        with self._store.transaction() as session:
            result = api_keys.authenticate(session, presented, self._store.key_secret)
            if not isinstance(result, KeyPrincipal):
                return result, _key_id_of(presented)
            tenant = get_tenant_by_id(session, result.tenant_id)
            snapshot = TenantSnapshot(
                tenant.sharing_mode,
                tenant.may_use_public_prefixes,
                tenant.cache_quota_blocks,
                tenant.cache_reservation_blocks,
                tenant.requests_per_minute,
                tenant.tokens_per_minute,
                tenant.max_concurrent,
            )
            return Principal(str(result.tenant_id), result.tenant_slug, result.key_id,
                             result.role, snapshot)  # fmt: skip


def _key_id_of(presented: str) -> str | None:
    parts = presented.split("_")
    return parts[1][:32] if len(parts) == 3 and parts[0] == "pgk" else None
