"""/admin/api/tenants/{id}/keys: a key's secret is shown once, and revocation and rotation
bite on the very next request; a tenant-admin manages its own tenant's keys and no other's."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from tests.support.admin import admin_client, login
from tests.support.gateway import MODEL, Gateway


@pytest.fixture(scope="module")
def admin_token(gateway: Gateway) -> str:
    """One admin session for the module (logins are throttled per address)."""
    return login(gateway)


def _new_tenant(client: httpx.Client) -> str:
    answer = client.post("/tenants", json={"slug": f"k-{uuid.uuid4().hex[:10]}"})
    assert answer.status_code == 201, answer.text
    tenant_id: str = answer.json()["id"]
    return tenant_id


def _new_key(client: httpx.Client, tenant_id: str, **fields: object) -> dict[str, str]:
    answer = client.post(f"/tenants/{tenant_id}/keys", json={"name": "test", **fields})
    assert answer.status_code == 201, answer.text
    key: dict[str, str] = answer.json()
    return key


def _chat_status(gateway: Gateway, key: str) -> int:
    """The status of one tiny chat request made with `key` through the official client."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    except openai.APIStatusError as error:
        return error.status_code
    return 200


def test_the_secret_is_shown_once_and_never_listed_or_audited(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id = _new_tenant(client)
        before = gateway.last_audit_seq()
        created = _new_key(client, tenant_id, role="tenant-admin")
        assert created["key"].startswith(f"pgk_{created['key_id']}_")
        assert created["state"] == "active" and created["role"] == "tenant-admin"
        listing = client.get(f"/tenants/{tenant_id}/keys")
        assert listing.status_code == 200
        assert [key["key_id"] for key in listing.json()] == [created["key_id"]]
        assert "key" not in listing.json()[0]
        assert created["key"] not in listing.text
    events = [e for e in gateway.audit_events(before) if e.action == "api_key.create"]
    assert [(e.outcome, e.tenant_id) for e in events] == [("success", tenant_id)]
    assert events[0].details["after"]["key_id"] == created["key_id"]
    secret = created["key"].rsplit("_", 1)[1][:20]
    assert not [e for e in gateway.audit_events(before) if secret in json.dumps(e.details)]


def test_a_revoked_key_is_refused_on_the_very_next_request(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id = _new_tenant(client)
        key = _new_key(client, tenant_id)
        assert _chat_status(gateway, key["key"]) == 200  # now remembered by the key cache
        revoked = client.post(f"/tenants/{tenant_id}/keys/{key['key_id']}/revoke")
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["state"] == "revoked"
        assert _chat_status(gateway, key["key"]) == 401


def test_rotation_keeps_the_old_key_for_its_grace_and_no_longer(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id = _new_tenant(client)
        first = _new_key(client, tenant_id)
        assert _chat_status(gateway, first["key"]) == 200
        before = gateway.last_audit_seq()
        rotate = f"/tenants/{tenant_id}/keys/{first['key_id']}/rotate"
        second = client.post(rotate, json={"grace_seconds": 3600})
        assert second.status_code == 201, second.text
        assert second.json()["key"] != first["key"]
        assert _chat_status(gateway, first["key"]) == 200  # in its grace period
        assert _chat_status(gateway, second.json()["key"]) == 200
        listing = client.get(f"/tenants/{tenant_id}/keys").json()
        states = {key["key_id"]: key["state"] for key in listing}
        assert states == {first["key_id"]: "rotating", second.json()["key_id"]: "active"}
        # Rotating the old key again would move its end of grace: refused, audited.
        assert client.post(rotate, json={"grace_seconds": 86_400}).status_code == 409
        events = [e for e in gateway.audit_events(before) if e.action == "api_key.rotate"]
        assert [(e.outcome, e.resource_id) for e in events] == [
            ("success", first["key_id"]),
            ("failure", first["key_id"]),
        ]
        assert events[0].details["before"]["state"] == "active"
        assert events[0].details["after"]["state"] == "rotating"
        assert events[0].details["after"]["successor_key_id"] == second.json()["key_id"]

        third = client.post(
            f"/tenants/{tenant_id}/keys/{second.json()['key_id']}/rotate", json={"grace_seconds": 0}
        )
        assert third.status_code == 201, third.text
        assert _chat_status(gateway, second.json()["key"]) == 401
        assert _chat_status(gateway, third.json()["key"]) == 200


def test_expiry_must_carry_a_time_zone_and_lie_ahead(gateway: Gateway, admin_token: str) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id = _new_tenant(client)
        keys = f"/tenants/{tenant_id}/keys"
        # A time zone offset that takes the year past 9999 in UTC was a 500 (and no audit event).
        out_of_range = ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00", 4102444800)
        for expires_at in ("2099-01-01T00:00:00", "2000-01-01T00:00:00Z", "soon", *out_of_range):
            answer = client.post(keys, json={"name": "x", "expires_at": expires_at})
            assert answer.status_code == 400, (expires_at, answer.text)
            assert answer.json()["error"]["param"] == "expires_at"
        later = datetime.now(UTC) + timedelta(days=30)
        created = _new_key(client, tenant_id, expires_at=later.isoformat())
        assert datetime.fromisoformat(created["expires_at"]) == later
        assert [key["key_id"] for key in client.get(keys).json()] == [created["key_id"]]


def test_a_tenant_admin_manages_its_own_keys_and_no_other_tenants(
    gateway: Gateway, admin_token: str
) -> None:
    with admin_client(gateway, admin_token) as admin:
        own, other = _new_tenant(admin), _new_tenant(admin)
        tenant_admin = _new_key(admin, own, role="tenant-admin")
        foreign = _new_key(admin, other)
    with admin_client(gateway, tenant_admin["key"]) as client:
        created = _new_key(client, own, role="tenant-admin")
        assert created["role"] == "tenant-admin"
        assert client.get(f"/tenants/{own}/keys").status_code == 200
        for answer in (
            client.get(f"/tenants/{other}/keys"),
            client.post(f"/tenants/{other}/keys", json={"name": "mine now"}),
            client.post(f"/tenants/{other}/keys/{foreign['key_id']}/revoke"),
            client.post(f"/tenants/{own}/keys/{foreign['key_id']}/revoke"),
            client.post(f"/tenants/{other}/keys/{foreign['key_id']}/rotate", json={}),
        ):
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["type"] == "not_found_error"
        assert _chat_status(gateway, foreign["key"]) == 200  # untouched
        # A tenant-admin key may revoke itself; the revocation is its last call.
        revoked = client.post(f"/tenants/{own}/keys/{tenant_admin['key_id']}/revoke")
        assert revoked.status_code == 200
        assert client.get(f"/tenants/{own}/keys").status_code == 401


def test_every_refusal_is_one_audited_failure(gateway: Gateway, admin_token: str) -> None:
    with admin_client(gateway, admin_token) as client:
        tenant_id = _new_tenant(client)
        before = gateway.last_audit_seq()
        missing = client.post(f"/tenants/{tenant_id}/keys/nosuchkey000/revoke")
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"
        unknown_tenant = client.post(f"/tenants/{uuid.uuid4()}/keys", json={"name": "x"})
        assert unknown_tenant.status_code == 404
    events = [e for e in gateway.audit_events(before) if e.action.startswith("api_key.")]
    assert [(e.action, e.outcome) for e in events] == [
        ("api_key.revoke", "failure"),
        ("api_key.create", "failure"),
    ]
