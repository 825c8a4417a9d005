"""A tenant's second-tier quota and reservation, in bytes (None: the default), on PostgreSQL
and SQLite: what is refused, what a partial change keeps, and the default coming back."""

from __future__ import annotations

import pytest

from tenancy import tenants
from tenancy.errors import InvalidInput
from tenancy.store import Store
from tenancy.tenants import MAX_TIER_BYTES, TenantLimits

GIB = 1 << 30


def tier_of(store: Store, slug: str) -> tuple[int | None, int | None]:
    with store.transaction() as session:
        tenant = tenants.get_tenant(session, slug)
        return tenant.tier_quota_bytes, tenant.tier_reservation_bytes


def test_a_new_tenant_has_the_default_tier_budget_unless_given_one(store: Store) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme")
        given = TenantLimits(tier_quota_bytes=8 * GIB, tier_reservation_bytes=GIB)
        tenants.create_tenant(session, "globex", limits=given)
    assert tier_of(store, "acme") == (None, None)
    assert tier_of(store, "globex") == (8 * GIB, GIB)  # past 32 bits: a BIGINT
    with store.transaction() as session:
        assert (
            tenants.tenant_settings(tenants.get_tenant(session, "globex"))["tier_quota_bytes"]
            == 8 * GIB
        )


@pytest.mark.parametrize(
    ("limits", "field", "message"),
    [
        (TenantLimits(tier_quota_bytes=-1), "tier_quota_bytes", "tier quota must be between"),
        (TenantLimits(tier_reservation_bytes=-1), "tier_reservation_bytes", "between 0 and"),
        (TenantLimits(tier_quota_bytes=MAX_TIER_BYTES + 1), "tier_quota_bytes", "between 0"),
        (TenantLimits(tier_quota_bytes=GIB, tier_reservation_bytes=GIB + 1),
         "tier_reservation_bytes", "must not exceed the tier quota"),
    ],
)  # fmt: skip
def test_a_bad_tier_budget_is_refused_naming_its_field(
    store: Store, limits: TenantLimits, field: str, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message) as refused, store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=limits)
    assert refused.value.field == field


def test_set_quota_changes_what_it_is_given_and_none_brings_the_default_back(
    store: Store,
) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(cache_quota_blocks=64))
    with store.transaction() as session:
        tenants.set_quota(session, "acme", tier_quota_bytes=4 * GIB)
    assert tier_of(store, "acme") == (4 * GIB, None)
    with store.transaction() as session:  # the pool quota alone: the tier's stays
        tenants.set_quota(session, "acme", quota_blocks=32, tier_reservation_bytes=GIB)
    assert tier_of(store, "acme") == (4 * GIB, GIB)
    with pytest.raises(InvalidInput) as refused, store.transaction() as session:
        tenants.set_quota(session, "acme", tier_quota_bytes=GIB // 2)  # under the reservation
    assert refused.value.field == "tier_reservation_bytes"
    assert tier_of(store, "acme") == (4 * GIB, GIB)
    with store.transaction() as session:
        tenant = tenants.set_quota(session, "acme", tier_quota_bytes=None)
        assert tenant.cache_quota_blocks == 32  # what was not given stays
    assert tier_of(store, "acme") == (None, GIB)
    with pytest.raises(InvalidInput, match="give a new quota"), store.transaction() as session:
        tenants.set_quota(session, "acme")
