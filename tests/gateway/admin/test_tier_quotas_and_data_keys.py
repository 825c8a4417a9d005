"""The second KV tier's side of a tenant through the real gateway: its tier quota and
reservation set and read through the admin API and the console (a refusal in OpenAI's error
shape, or the form again with the message), audited; and a deleted tenant's or public prefix's
data key shredded with it, which the deletion's audit event says."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.console.pages import format_bytes
from tenancy.models import WrappedDataKey
from tenancy.seal_keys import DataKeyShredded, prefix_data_key, tenant_data_key
from tests.support.admin import admin_client, login
from tests.support.browser import ConsoleSession
from tests.support.gateway import Gateway

MIB, GIB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def admin(gateway: Gateway) -> Iterator[httpx.Client]:
    """One admin session for the module (logins are throttled per address)."""
    with admin_client(gateway, login(gateway)) as client:
        yield client


def new_tenant(admin: httpx.Client, **fields: Any) -> dict[str, Any]:
    answer = admin.post("/tenants", json={"slug": f"tier-{uuid.uuid4().hex[:10]}", **fields})
    assert answer.status_code == 201, answer.text
    tenant: dict[str, Any] = answer.json()
    return tenant


def tier(tenant: dict[str, Any]) -> tuple[int | None, int | None]:
    return tenant["tier_quota_bytes"], tenant["tier_reservation_bytes"]


def test_the_admin_api_sets_reads_and_resets_a_tier_quota(
    gateway: Gateway, admin: httpx.Client
) -> None:
    assert tier(new_tenant(admin)) == (None, None)  # the default
    tenant = new_tenant(admin, tier_quota_bytes=8 * GIB, tier_reservation_bytes=GIB)
    assert tier(tenant) == (8 * GIB, GIB)
    path = f"/tenants/{tenant['id']}"
    before = gateway.last_audit_seq()
    answer = admin.put(f"{path}/quota", json={"quota_blocks": 30, "tier_quota_bytes": 2 * GIB})
    assert answer.status_code == 200, answer.text
    assert tier(answer.json()) == (2 * GIB, GIB) and answer.json()["quota"]["blocks"] == 30
    assert tier(admin.get(path).json()) == (2 * GIB, GIB)
    assert tier(admin.put(f"{path}/quota", json={"quota_blocks": 31}).json()) == (2 * GIB, GIB)
    reset = admin.put(f"{path}/quota", json={"tier_reservation_bytes": None})  # null: default
    assert reset.status_code == 200, reset.text
    assert tier(reset.json()) == (2 * GIB, None)
    events = [e for e in gateway.audit_events(before) if e.action == "tenant.set_quota"]
    assert [e.outcome for e in events] == ["success"] * 3
    assert events[0].details["before"]["tier_quota_bytes"] == 8 * GIB
    assert events[0].details["after"]["tier_quota_bytes"] == 2 * GIB
    assert events[2].details["after"]["tier_reservation_bytes"] is None


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tier_reservation_bytes": 3 * GIB}, "tier_reservation_bytes",
         "must not exceed the tier quota"),
        ({"tier_quota_bytes": -1}, "tier_quota_bytes", "greater than or equal to 0"),
        ({"tier_quota_bytes": 1 << 63}, "tier_quota_bytes", "less than or equal to"),
        ({"tier_quota_bytes": "1GiB"}, "tier_quota_bytes", "valid integer"),
    ],
)  # fmt: skip
def test_a_bad_tier_quota_is_a_400_in_openais_shape_and_changes_nothing(
    gateway: Gateway, admin: httpx.Client, body: dict[str, Any], param: str, message: str
) -> None:
    tenant = new_tenant(admin, tier_quota_bytes=2 * GIB)
    before = gateway.last_audit_seq()
    answer = admin.put(f"/tenants/{tenant['id']}/quota", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert message in error["message"]
    assert tier(admin.get(f"/tenants/{tenant['id']}").json()) == (2 * GIB, None)
    if param == "tier_reservation_bytes":  # refused by the tenancy rules: audited as a failure
        events = [e for e in gateway.audit_events(before) if e.action == "tenant.set_quota"]
        assert [e.outcome for e in events] == ["failure"]
    slug = f"tier-{uuid.uuid4().hex[:10]}"
    created = admin.post("/tenants", json={"slug": slug, "tier_quota_bytes": 2 * GIB, **body})
    assert (created.status_code, created.json()["error"]["param"]) == (400, param)


def test_the_console_shows_and_saves_the_tier_quota_in_human_bytes(
    gateway: Gateway, admin: httpx.Client
) -> None:
    tenant = new_tenant(admin, cache_quota_blocks=8)
    page_path = f"/admin/tenants/{tenant['id']}"
    pool_bytes = tenant["quota"]["bytes"]
    with ConsoleSession(gateway) as console:
        page = console.get(page_path).text
        meaning = page.split('id="tier-quota-meaning"')[1].split("</p>")[0]
        assert f"default ({format_bytes(pool_bytes)}, the pool quota" in meaning
        assert field(page, "tier_quota") == ""
        saved = console.post(
            f"{page_path}/quota",
            {"tier_quota": "1.5", "tier_quota_unit": "GiB",
             "tier_reservation": "512", "tier_reservation_unit": "MiB"},
        )  # fmt: skip
        assert saved.status_code == 303, saved.text
        assert tier(admin.get(f"/tenants/{tenant['id']}").json()) == (1536 * MIB, 512 * MIB)
        page = console.get(page_path).text
        assert "Cache quota saved" in page
        meaning = page.split('id="tier-quota-meaning"')[1].split("</p>")[0]
        assert "1.5 GiB" in meaning and "512.0 MiB" in meaning
        # Back in the units it was saved in when they hold it whole (1.5 GiB does not).
        assert (field(page, "tier_quota"), unit(page, "tier_quota_unit")) == ("1536", "MiB")
        assert (field(page, "tier_reservation"), unit(page, "tier_reservation_unit")) == (
            "512",
            "MiB",
        )
        # A reservation over the quota: the form again, the message at its field, nothing saved.
        refused = console.post(
            f"{page_path}/quota",
            {"tier_quota": "1", "tier_quota_unit": "GiB",
             "tier_reservation": "2", "tier_reservation_unit": "GiB"},
        )  # fmt: skip
        assert refused.status_code == 400
        error = re.search(r'id="quota-tier_reservation-error">([^<]*)<', refused.text)
        assert error is not None and "must not exceed the tier quota" in error.group(1)
        assert field(refused.text, "tier_reservation") == "2"  # as typed
        for bad in ("lots", "1e999999", "NaN"):  # the huge one refused before it is multiplied
            refused = console.post(f"{page_path}/quota", {"tier_quota": bad})
            assert refused.status_code == 400, bad
            assert 'id="quota-tier_quota-error"' in refused.text, bad
        assert tier(admin.get(f"/tenants/{tenant['id']}").json()) == (1536 * MIB, 512 * MIB)
        # The pool quota alone (a form without the tier's fields) leaves the tier's as it is;
        # emptied fields bring the default back.
        assert console.post(f"{page_path}/quota", {"quota": "9"}).status_code == 303
        assert tier(admin.get(f"/tenants/{tenant['id']}").json()) == (1536 * MIB, 512 * MIB)
        emptied = {"tier_quota": "", "tier_reservation": ""}
        assert console.post(f"{page_path}/quota", emptied).status_code == 303
        assert tier(admin.get(f"/tenants/{tenant['id']}").json()) == (None, None)


def field(page: str, name: str) -> str:
    found = re.search(rf'<input id="quota-{name}"[^>]*value="([^"]*)"', page)
    assert found is not None, name
    return found.group(1)


def unit(page: str, name: str) -> str:
    select = page.split(f'id="quota-{name}"')[1].split("</select>")[0]
    found = re.search(r'<option value="([^"]*)" selected>', select)
    assert found is not None, name
    return found.group(1)


def test_deleting_a_tenant_shreds_its_data_key_and_the_event_says_so(
    gateway: Gateway, admin: httpx.Client
) -> None:
    state = gateway.server.gateway
    master_key = state.settings.master_key_bytes()
    keyed, unkeyed = new_tenant(admin), new_tenant(admin)
    tenant_id = uuid.UUID(keyed["id"])
    with state.store.transaction() as session:
        tenant_data_key(session, master_key, tenant_id)
    before = gateway.last_audit_seq()
    assert admin.delete(f"/tenants/{keyed['id']}").status_code == 204
    assert admin.delete(f"/tenants/{unkeyed['id']}").status_code == 204
    events = [e for e in gateway.audit_events(before) if e.action == "tenant.delete"]
    assert [(e.resource_id, e.outcome, e.details["data_key_shredded"]) for e in events] == [
        (keyed["id"], "success", True),
        (unkeyed["id"], "success", False),
    ]
    with state.store.transaction() as session:
        assert session.get(WrappedDataKey, f"tenant:{tenant_id}") is None
        with pytest.raises(DataKeyShredded):
            tenant_data_key(session, master_key, tenant_id)


def test_deleting_a_prefix_shreds_its_data_key_and_the_event_says_so(
    gateway: Gateway, admin: httpx.Client
) -> None:
    state = gateway.server.gateway
    text = f"You answer questions about train {uuid.uuid4().hex[:8]} timetables, briefly."
    answer = admin.post("/prefixes", json={"namespace": "default", "name": "trains", "text": text})
    assert answer.status_code == 201, answer.text
    prefix_id = uuid.UUID(answer.json()["id"])
    with state.store.transaction() as session:
        prefix_data_key(session, state.settings.master_key_bytes(), prefix_id)
    before = gateway.last_audit_seq()
    assert admin.delete(f"/prefixes/{prefix_id}").status_code == 204
    events = [e for e in gateway.audit_events(before) if e.action == "prefix.delete"]
    assert [(e.outcome, e.details["data_key_shredded"]) for e in events] == [("success", True)]
    with state.store.transaction() as session:
        assert session.get(WrappedDataKey, f"prefix:{prefix_id}") is None
