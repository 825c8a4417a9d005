"""/admin/api/tenants: what an admin can do to tenants, and what a tenant-admin cannot."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tenancy import api_keys, tenants
from tests.support.admin import admin_client
from tests.support.gateway import Gateway


def _new_tenant(client: httpx.Client, **fields: object) -> dict[str, object]:
    slug = f"t-{uuid.uuid4().hex[:10]}"
    answer = client.post("/tenants", json={"slug": slug, **fields})
    assert answer.status_code == 201, answer.text
    tenant: dict[str, object] = answer.json()
    return tenant


def test_admin_creates_updates_and_finds_a_tenant(gateway: Gateway) -> None:
    with admin_client(gateway) as client:
        tenant = _new_tenant(client, display_name="Wayne Enterprises", cache_quota_blocks=32)
        assert tenant["quota"] == {
            "blocks": 32,
            "tokens": 32 * 16,
            "bytes": 32 * gateway.server.gateway.engine.pool.spec.bytes_per_block,
        }
        changed = client.patch(
            f"/tenants/{tenant['id']}", json={"sharing_mode": "tenant", "max_concurrent": 3}
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["sharing_mode"] == "tenant"
        assert changed.json()["max_concurrent"] == 3
        found = client.get("/tenants", params={"q": "wayne"}).json()
        assert [row["id"] for row in found["data"]] == [tenant["id"]]
        assert found["total"] == 1


def test_quota_change_reaches_the_engine_in_the_same_response(gateway: Gateway) -> None:
    with admin_client(gateway) as client:
        tenant = _new_tenant(client, cache_quota_blocks=40)
        answer = client.put(
            f"/tenants/{tenant['id']}/quota", json={"quota_tokens": 100, "reservation_blocks": 2}
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["quota"]["blocks"] == 7  # 100 tokens in 16-token blocks, rounded up
        assert body["cache"]["quota_blocks"] == 7
        assert body["cache"]["reserved_blocks"] == 2
        budget = gateway.server.gateway.engine.cache.budget(str(tenant["id"]))
        assert (budget.quota_blocks, budget.reserved_blocks) == (7, 2)


def test_quota_refusals_name_the_field_and_change_nothing(gateway: Gateway) -> None:
    with admin_client(gateway) as client:
        tenant = _new_tenant(client, cache_quota_blocks=10)
        too_much = client.put(f"/tenants/{tenant['id']}/quota", json={"reservation_blocks": 11})
        assert too_much.status_code == 400
        assert too_much.json()["error"]["param"] == "cache_reservation_blocks"
        both = client.put(
            f"/tenants/{tenant['id']}/quota", json={"quota_blocks": 1, "quota_tokens": 16}
        )
        assert both.status_code == 400
        assert client.get(f"/tenants/{tenant['id']}").json()["quota"]["blocks"] == 10


def test_tenant_admin_sees_only_its_own_tenant(gateway: Gateway) -> None:
    with admin_client(gateway) as admin:
        rows = admin.get("/tenants", params={"q": "acme", "limit": 500}).json()["data"]
        acme_id = next(row["id"] for row in rows if row["slug"] == "acme")
        globex_id = next(
            row["id"]
            for row in admin.get("/tenants", params={"q": "globex"}).json()["data"]
            if row["slug"] == "globex"
        )
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as acme:
        assert acme.get(f"/tenants/{acme_id}").status_code == 200
        listed = acme.get("/tenants").json()
        assert [row["slug"] for row in listed["data"]] == ["acme"]
        other = acme.get(f"/tenants/{globex_id}")
        assert other.status_code == 404
        assert "globex" not in other.text
        after = gateway.last_audit_seq()
        assert acme.put(f"/tenants/{acme_id}/quota", json={"quota_blocks": 1}).status_code == 403
        assert acme.delete(f"/tenants/{globex_id}").status_code == 403
        refused = [
            (e.action, e.outcome, e.actor_type, e.tenant_id) for e in gateway.audit_events(after)
        ]
        assert refused == [  # a reach into globex is in acme's own log, not globex's
            ("tenant.set_quota", "failure", "api_key", acme_id),
            ("tenant.delete", "failure", "api_key", acme_id),
        ]


def test_inference_key_cannot_administer(gateway: Gateway) -> None:
    with admin_client(gateway, gateway.keys["acme"]) as client:
        answer = client.get("/tenants")
        assert answer.status_code == 403
        assert answer.json()["error"]["type"] == "permission_error"


def test_delete_purges_and_hides_the_tenant(gateway: Gateway) -> None:
    state = gateway.server.gateway
    with admin_client(gateway) as client:
        tenant = _new_tenant(client)
        with state.store.transaction() as session:
            row = tenants.get_tenant(session, str(tenant["slug"]))
            key = api_keys.create_key(session, row, "t", state.store.key_secret).secret
        chat = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
        chat.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "hello there " * 40}],
            max_tokens=2,
        )
        cached = _cached_blocks_soon(gateway, str(tenant["id"]))
        assert cached > 0
        assert client.delete(f"/tenants/{tenant['id']}").status_code == 204
        stats = state.engine.cache_stats().owners[str(tenant["id"])]
        assert (stats.active_blocks, stats.cached_blocks) == (0, 0)
        assert stats.counters.purged_blocks >= cached
        with pytest.raises(openai.AuthenticationError):
            chat.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert client.get(f"/tenants/{tenant['id']}").status_code == 404
        events = [
            event
            for event in gateway.audit_events()
            if event.action == "tenant.delete" and event.resource_id == tenant["id"]
        ]
        assert [event.outcome for event in events] == ["success"]
        assert events[0].details["before"]["status"] == "active"
        assert events[0].details["after"]["status"] == "deleted"


def _cached_blocks_soon(gateway: Gateway, tenant_id: str) -> int:
    """The tenant's idle cached blocks once the engine's step that ended its request is in
    the stats (the answer can leave before that step's snapshot)."""
    deadline = time.monotonic() + 5
    while True:
        owner = gateway.server.gateway.engine.cache_stats().owners.get(tenant_id)
        cached = 0 if owner is None else owner.cached_blocks
        if cached or time.monotonic() > deadline:
            return cached
        time.sleep(0.02)
