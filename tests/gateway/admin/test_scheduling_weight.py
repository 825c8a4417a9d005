"""/admin/api: a tenant's scheduling weight is set at creation or by a PATCH, audited like the
other limits, refused out of range (or null) with a 400 naming it, and shown beside its observed
share to an operator, never to a tenant-admin (the share would tell it every tenant's service)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.support.admin import admin_client
from tests.support.gateway import Gateway


def new_tenant(client: httpx.Client, **fields: object) -> dict[str, object]:
    answer = client.post("/tenants", json={"slug": f"w-{uuid.uuid4().hex[:10]}", **fields})
    assert answer.status_code == 201, answer.text
    tenant: dict[str, object] = answer.json()
    return tenant


def test_a_tenant_weighs_one_unless_created_or_patched_to_weigh_otherwise(
    gateway: Gateway,
) -> None:
    with admin_client(gateway) as client:
        assert new_tenant(client)["scheduling_weight"] == 1.0
        tenant = new_tenant(client, scheduling_weight=2.5)
        assert tenant["scheduling_weight"] == 2.5
        after = gateway.last_audit_seq()
        changed = client.patch(f"/tenants/{tenant['id']}", json={"scheduling_weight": 0.25})
        assert changed.status_code == 200, changed.text
        assert changed.json()["scheduling_weight"] == 0.25
        assert changed.json()["max_concurrent"] == tenant["max_concurrent"]  # nothing else
        assert client.get(f"/tenants/{tenant['id']}").json()["scheduling_weight"] == 0.25
    events = [event for event in gateway.audit_events(after) if event.action.startswith("tenant")]
    assert [(event.action, event.outcome) for event in events] == [("tenant.update", "success")]
    details = events[0].details
    assert (details["before"]["scheduling_weight"], details["after"]["scheduling_weight"]) == (
        2.5,
        0.25,
    )


@pytest.mark.parametrize("weight", [0, 0.005, -1, 100.01, 1e9, "2", True, None])
def test_a_weight_out_of_range_is_a_400_naming_it_and_changes_nothing(
    gateway: Gateway, weight: object
) -> None:
    with admin_client(gateway) as client:
        slug = f"w-{uuid.uuid4().hex[:10]}"
        created = client.post("/tenants", json={"slug": slug, "scheduling_weight": weight})
        assert created.status_code == 400, created.text
        assert created.json()["error"]["param"] == "scheduling_weight"
        assert client.get("/tenants", params={"q": slug}).json()["total"] == 0
        tenant = new_tenant(client, scheduling_weight=3.0)
        patched = client.patch(f"/tenants/{tenant['id']}", json={"scheduling_weight": weight})
        assert patched.status_code == 400, patched.text  # null too: it is not a weight
        assert patched.json()["error"]["param"] == "scheduling_weight"
        assert client.get(f"/tenants/{tenant['id']}").json()["scheduling_weight"] == 3.0
        other = client.patch(f"/tenants/{tenant['id']}", json={"max_concurrent": 5})
        assert other.status_code == 200, other.text  # left out, the weight stays
        assert other.json()["scheduling_weight"] == 3.0


def test_usage_shows_the_weight_beside_the_observed_share(gateway: Gateway) -> None:
    with admin_client(gateway) as client:
        tenant = new_tenant(client, scheduling_weight=4.0)
        usage = client.get(f"/tenants/{tenant['id']}/usage").json()
        assert usage["scheduling_weight"] == 4.0
        assert (usage["summary"]["service"], usage["summary"]["service_share"]) == (0.0, 0.0)
        rows = client.get("/usage", params={"q": str(tenant["slug"])}).json()["data"]
        assert [(row["scheduling_weight"], row["summary"]["service_share"]) for row in rows] == [
            (4.0, 0.0)
        ]


def test_a_tenant_admin_gets_its_own_service_but_never_its_share(gateway: Gateway) -> None:
    # Its service over its share would be every tenant's service: less its own, the others'.
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as acme:
        (row,) = acme.get("/usage").json()["data"]
        own = acme.get(f"/tenants/{row['tenant_id']}/usage", params={"window_s": 60}).json()
    for summary in (row["summary"], own["summary"]):
        assert isinstance(summary["service"], float)
        assert summary["service_share"] is None
    with admin_client(gateway) as operator:
        seen = operator.get(f"/tenants/{row['tenant_id']}/usage", params={"window_s": 60}).json()
        rows = operator.get("/usage", params={"q": "acme"}).json()["data"]
    assert isinstance(seen["summary"]["service_share"], float)
    assert all(isinstance(listed["summary"]["service_share"], float) for listed in rows)
