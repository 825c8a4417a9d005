"""The gateway's key cache never outlives a tenancy change, even one that lands mid-lookup."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from gateway.auth.key_auth import AuthenticationFailed, Caller, KeyAuthenticator
from tenancy import api_keys, tenants
from tenancy.api_keys import AuthFailure
from tenancy.errors import InvalidInput
from tenancy.store import Store
from tenancy.tenants import RESERVED_SLUGS


class _SlowLookups(KeyAuthenticator):
    """The real authenticator, whose database lookups wait for the test's signal."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, ttl=30.0, stale_ttl=300.0)
        self.looking = threading.Event()
        self.proceed = threading.Event()

    def _lookup(self, presented: str) -> Caller | tuple[AuthFailure, str | None]:
        result = super()._lookup(presented)
        self.looking.set()
        assert self.proceed.wait(10)
        return result


def test_a_revocation_during_a_lookup_is_not_undone_by_the_lookups_answer(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = Store.open(sqlite_url, tmp_path / "audit.spool", "key-secret", "signing-key")
    with store.transaction() as session:
        tenant = tenants.create_tenant(session, "acme")
        created = api_keys.create_key(session, tenant, "k", "key-secret")
    auth = _SlowLookups(store)

    async def scenario() -> None:
        lookup = asyncio.create_task(auth.authenticate(created.secret))
        await asyncio.to_thread(auth.looking.wait, 10)  # the key checked out as valid...
        with store.transaction() as session:  # ...then it is revoked, and the poll arrives
            api_keys.revoke_key(session, tenant.id, created.key.key_id)
        auth.forget_all()
        auth.proceed.set()
        assert isinstance(await lookup, Caller)  # the request that raced the change
        with pytest.raises(AuthenticationFailed):  # the next one sees the revocation
            await auth.authenticate(created.secret)

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_the_public_budgets_name_is_not_a_tenant_slug(sqlite_url: str, tmp_path: Path) -> None:
    store = Store.open(sqlite_url, tmp_path / "audit.spool", "key-secret", "signing-key")
    try:
        for slug in RESERVED_SLUGS:
            with pytest.raises(InvalidInput, match="reserved"), store.transaction() as session:
                tenants.create_tenant(session, slug)
    finally:
        store.close()


def test_a_checked_key_carries_its_tenants_weight_until_a_change_drops_it(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = Store.open(sqlite_url, tmp_path / "audit.spool", "key-secret", "signing-key")
    with store.transaction() as session:
        limits = tenants.TenantLimits(scheduling_weight=2.5)
        tenant = tenants.create_tenant(session, "acme", limits=limits)
        created = api_keys.create_key(session, tenant, "k", "key-secret")
    auth = KeyAuthenticator(store, ttl=30.0, stale_ttl=300.0)

    async def weight() -> float:
        return (await auth.authenticate(created.secret)).tenant.scheduling_weight

    try:
        assert asyncio.run(weight()) == 2.5
        with store.transaction() as session:
            tenants.set_scheduling_weight(session, "acme", 0.5)
        assert asyncio.run(weight()) == 2.5  # remembered until the change is heard of
        auth.forget_all()  # what every gateway does when the change counter moves
        assert asyncio.run(weight()) == 0.5
    finally:
        store.close()
