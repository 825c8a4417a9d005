"""Quotas and reservations against the KV pool a server recorded; only given options change."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenancy import deployment, tenants
from tenancy.errors import InvalidInput
from tenancy.store import Store
from tenancy.tenants import TenantLimits
from tests.support.cli import Cli


def record_pool(store: Store, blocks: int) -> None:
    with store.transaction() as session:
        deployment.record_pool_blocks(session, blocks)


def quota_of(store: Store, slug: str) -> tuple[int, int]:
    with store.transaction() as session:
        tenant = tenants.get_tenant(session, slug)
        return tenant.cache_quota_blocks, tenant.cache_reservation_blocks


def test_set_quota_changes_only_what_is_given(store: Store) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(16, 4))
    with store.transaction() as session:
        tenants.set_quota(session, "acme", quota_blocks=8)
    assert quota_of(store, "acme") == (8, 4)  # the reservation stayed
    with store.transaction() as session:
        tenants.set_quota(session, "acme", reservation_blocks=2)
    assert quota_of(store, "acme") == (8, 2)
    with pytest.raises(InvalidInput, match="give a new quota"), store.transaction() as session:
        tenants.set_quota(session, "acme")


def test_a_quota_larger_than_the_recorded_pool_is_refused(store: Store) -> None:
    record_pool(store, 100)
    with pytest.raises(InvalidInput) as raised, store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(101))
    assert "cache quota (101 blocks) is larger than the KV pool (100 blocks" in str(raised.value)
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(100))
    with pytest.raises(InvalidInput, match="larger than the KV pool"), store.transaction() as s:
        tenants.set_quota(s, "acme", 5000)


def test_all_reservations_together_must_fit_in_the_pool(store: Store) -> None:
    record_pool(store, 100)
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(60, 60))
    with pytest.raises(InvalidInput) as raised, store.transaction() as session:
        tenants.create_tenant(session, "globex", limits=TenantLimits(50, 50))
    assert str(raised.value) == (
        "cache reservations would total 110 blocks, more than the KV pool's 100 "
        "(other tenants reserve 60)"
    )
    with store.transaction() as session:
        tenants.create_tenant(session, "globex", limits=TenantLimits(50, 40))
        tenants.create_tenant(session, "gone", limits=TenantLimits(10, 0))
    with pytest.raises(InvalidInput, match="would total 101"), store.transaction() as session:
        tenants.set_quota(session, "gone", reservation_blocks=1)
    with store.transaction() as session:  # a deleted tenant's reservation is free again
        tenants.delete_tenant(session, "globex")
        tenants.set_quota(session, "gone", reservation_blocks=10)


def test_after_the_pool_shrinks_lowering_is_always_allowed(store: Store) -> None:
    record_pool(store, 100)
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(60, 40))
        tenants.create_tenant(session, "globex", limits=TenantLimits(50, 30))
    record_pool(store, 50)  # a server restarted with less memory
    with store.transaction() as session:
        tenants.set_quota(session, "globex", reservation_blocks=20)  # still 60 > 50, but less
        tenants.set_quota(session, "acme", reservation_blocks=30)  # quota 60 > 50 unchanged
    with pytest.raises(InvalidInput, match="would total 56"), store.transaction() as session:
        tenants.set_quota(session, "globex", reservation_blocks=26)
    assert quota_of(store, "globex") == (50, 20)


def test_the_default_quota_is_capped_at_the_pool(store: Store) -> None:
    with store.transaction() as session:
        assert tenants.create_tenant(session, "before").cache_quota_blocks == 1024
    record_pool(store, 300)
    with store.transaction() as session:
        assert tenants.create_tenant(session, "after").cache_quota_blocks == 300


def test_cli_set_quota_keeps_the_reservation_and_says_when_no_pool_is_known(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    created = cli.ok("tenants", "create", "acme", "--quota", "16", "--reservation", "4")
    assert "not checked against the KV pool: no server has recorded its size yet" in created
    updated = cli.json("tenants", "set-quota", "acme", "--quota", "8")
    assert (updated["cache_quota_blocks"], updated["cache_reservation_blocks"]) == (8, 4)
    assert updated["pool_blocks"] is None
    assert cli.error("tenants", "set-quota", "acme").endswith(
        "give --quota, --reservation, --tier-quota-bytes or --tier-reservation-bytes"
    )
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "cli-signing-key")
    record_pool(store, 100)
    store.close()
    line = cli.error("tenants", "set-quota", "acme", "--quota", "4096")
    assert "cache quota (4096 blocks) is larger than the KV pool (100 blocks" in line
    assert "note:" not in cli.ok("tenants", "set-quota", "acme", "--reservation", "6")
    assert cli.json("tenants", "show", "acme")["cache_reservation_blocks"] == 6
