"""A tenant's scheduling weight, on PostgreSQL and SQLite (the `store` fixture): 1.0 unless set,
checked against its range wherever it is set, refused by the database itself out of range."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from tenancy import tenants
from tenancy.errors import InvalidInput
from tenancy.models import Tenant
from tenancy.store import Store
from tenancy.tenants import TenantChanges, TenantLimits

OUT_OF_RANGE = [0.0, 0.0099, -1.0, 100.5, math.inf, math.nan]


def weight_of(store: Store, slug: str) -> float:
    with store.transaction() as session:
        return tenants.get_tenant(session, slug).scheduling_weight


def test_a_new_tenant_weighs_one_unless_created_with_a_weight(store: Store) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme")
        tenants.create_tenant(session, "globex", limits=TenantLimits(scheduling_weight=2.5))
    assert (weight_of(store, "acme"), weight_of(store, "globex")) == (1.0, 2.5)
    with store.transaction() as session:
        listed = [tenants.tenant_settings(t) for t in tenants.list_tenants(session)]
    assert [(row["slug"], row["scheduling_weight"]) for row in listed] == [
        ("acme", 1.0),
        ("globex", 2.5),
    ]


@pytest.mark.parametrize("weight", OUT_OF_RANGE)
def test_a_weight_out_of_range_is_invalid_input_and_changes_nothing(
    store: Store, weight: float
) -> None:
    with pytest.raises(InvalidInput) as raised, store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(scheduling_weight=weight))
    assert raised.value.field == "scheduling_weight"
    assert "scheduling weight must be between 0.01 and 100" in str(raised.value)
    with store.transaction() as session:
        assert tenants.list_tenants(session) == []
        tenants.create_tenant(session, "acme", limits=TenantLimits(scheduling_weight=3.0))
    for change in (
        lambda s: tenants.set_scheduling_weight(s, "acme", weight),
        lambda s: tenants.update_tenant(s, "acme", TenantChanges(scheduling_weight=weight)),
    ):
        with pytest.raises(InvalidInput, match="scheduling weight"), store.transaction() as s:
            change(s)
    assert weight_of(store, "acme") == 3.0


@pytest.mark.parametrize(
    ("weight", "shown"),
    [(100.0001, "100.0001"), (0.0099999, "0.0099999"), (1e-07, "1e-07"), (-1.0, "-1")],
)
def test_a_refused_weight_is_shown_exactly_as_given(
    store: Store, weight: float, shown: str
) -> None:
    with pytest.raises(InvalidInput) as raised, store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(scheduling_weight=weight))
    assert str(raised.value) == f"scheduling weight must be between 0.01 and 100 (got {shown})"


def test_set_scheduling_weight_changes_only_the_weight(store: Store) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme", limits=TenantLimits(requests_per_minute=7))
    with store.transaction() as session:
        before = tenants.tenant_settings(tenants.get_tenant(session, "acme"))
        tenants.set_scheduling_weight(session, "acme", 0.01)
    with store.transaction() as session:
        after = tenants.tenant_settings(tenants.get_tenant(session, "acme"))
        tenants.set_scheduling_weight(session, "acme", 100)
    assert after == {**before, "scheduling_weight": 0.01}
    assert weight_of(store, "acme") == 100.0


def test_the_database_refuses_a_weight_out_of_range_written_around_the_checks(
    store: Store,
) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme")
    for weight in (0.001, 101.0):
        with pytest.raises(IntegrityError, match="scheduling_weight"), store.transaction() as s:
            s.execute(update(Tenant).where(Tenant.slug == "acme").values(scheduling_weight=weight))
    assert weight_of(store, "acme") == 1.0
