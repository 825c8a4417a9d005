"""/admin/api/prefixes: a prefix added through the API is shared across tenants from the next
request on, and a disabled or deleted one is shared no more (its cached blocks dropped); only
an admin manages them, and the audit log keeps a digest of the text, never the text."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.cache.budget import PUBLIC_OWNER
from engine.cache.stats import OwnerStats
from tests.support.admin import admin_client, login
from tests.support.gateway import MODEL, Gateway


@pytest.fixture(scope="module")
def admin(gateway: Gateway) -> Iterator[httpx.Client]:
    """One admin session for the module (logins are throttled per address)."""
    with admin_client(gateway, login(gateway)) as client:
        yield client


def _system_prompt() -> str:
    """A system prompt of several blocks that no other test sends."""
    tag = uuid.uuid4().hex[:8]
    return (
        f"You are the concierge of hotel {tag}. Check-in is at three, check-out at eleven. "
        "Breakfast is served from seven to ten in the garden room. Pets are welcome. "
        "Never reveal another guest's room number or name, whoever asks."
    )


def _tenant_key(admin: httpx.Client) -> str:
    """A new tenant (through the API) and an inference key for it."""
    tenant = admin.post("/tenants", json={"slug": f"p-{uuid.uuid4().hex[:10]}"})
    assert tenant.status_code == 201, tenant.text
    key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={"name": "chat"})
    assert key.status_code == 201, key.text
    secret: str = key.json()["key"]
    return secret


def _cached(gateway: Gateway, key: str, system: str, question: str) -> int:
    """Cached prompt tokens of one chat request, as the official client reports them."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=1,
        temperature=0,
    )
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens_details.cached_tokens or 0


def _public(gateway: Gateway) -> OwnerStats:
    return gateway.server.gateway.engine.cache_stats().owners[PUBLIC_OWNER]


def _add(admin: httpx.Client, text: str, name: str | None = None) -> dict[str, Any]:
    name = name or f"hotel-{uuid.uuid4().hex[:8]}"
    answer = admin.post("/prefixes", json={"namespace": "default", "name": name, "text": text})
    assert answer.status_code == 201, answer.text
    prefix: dict[str, Any] = answer.json()
    return prefix


def test_an_added_prefix_is_shared_across_tenants_until_it_is_deleted(
    gateway: Gateway, admin: httpx.Client
) -> None:
    system = _system_prompt()
    first, second, third = (_tenant_key(admin) for _ in range(3))
    assert _cached(gateway, first, system, "Where do I park?") == 0  # not registered yet
    prefix = _add(admin, system)
    try:
        assert prefix["model"] == MODEL and prefix["enabled"] is True
        assert isinstance(prefix["blocks"], int) and prefix["blocks"] >= 2
        assert prefix["blocks"] == prefix["tokens"] // 16
        assert prefix["warning"] is None
        shared = prefix["blocks"] * 16
        assert _cached(gateway, first, system, "Is there a pool?") == 0  # fills the blocks
        assert _cached(gateway, second, system, "Can I check in late?") == shared
        public_before = _public(gateway)
        assert public_before.cached_blocks >= prefix["blocks"]
    finally:
        assert admin.delete(f"/prefixes/{prefix['id']}").status_code == 204
    public_after = _public(gateway)
    purged = public_after.counters.purged_blocks - public_before.counters.purged_blocks
    assert purged == prefix["blocks"]
    assert public_after.cached_blocks == public_before.cached_blocks - prefix["blocks"]
    assert admin.get(f"/prefixes/{prefix['id']}").status_code == 404
    assert _cached(gateway, third, system, "Do you have a gym?") == 0


def test_a_disabled_prefix_is_not_shared_and_an_enabled_one_is_again(
    gateway: Gateway, admin: httpx.Client
) -> None:
    system = _system_prompt()
    first, second = _tenant_key(admin), _tenant_key(admin)
    prefix = _add(admin, system)
    shared = prefix["blocks"] * 16
    try:
        _cached(gateway, first, system, "Is there a pool?")
        assert _cached(gateway, second, system, "Where is the spa?") == shared
        disabled = admin.patch(f"/prefixes/{prefix['id']}", json={"enabled": False})
        assert disabled.status_code == 200 and disabled.json()["enabled"] is False
        assert _cached(gateway, first, system, "Is the bar open late?") == 0
        assert _cached(gateway, second, system, "Is the bar open late?") == 0
        enabled = admin.patch(f"/prefixes/{prefix['id']}", json={"enabled": True})
        assert enabled.status_code == 200 and enabled.json()["enabled"] is True
        _cached(gateway, first, system, "Can I borrow a bicycle?")
        assert _cached(gateway, second, system, "Is there room service?") == shared
    finally:
        admin.delete(f"/prefixes/{prefix['id']}")


def test_a_short_prefix_is_registered_with_a_warning(admin: httpx.Client) -> None:
    prefix = _add(admin, f"Be brief ({uuid.uuid4().hex[:6]}).")
    try:
        assert isinstance(prefix["blocks"], int) and prefix["blocks"] < 2
        assert "2 whole blocks" in str(prefix["warning"])
        listed = admin.get("/prefixes").json()
        assert [row["warning"] for row in listed if row["id"] == prefix["id"]] == [
            prefix["warning"]
        ]
    finally:
        admin.delete(f"/prefixes/{prefix['id']}")


def test_the_audit_log_keeps_a_digest_of_the_text_not_the_text(
    gateway: Gateway, admin: httpx.Client
) -> None:
    system = _system_prompt()
    before = gateway.last_audit_seq()
    prefix = _add(admin, system)
    admin.delete(f"/prefixes/{prefix['id']}")
    events = [e for e in gateway.audit_events(before) if e.action.startswith("prefix.")]
    assert [(e.action, e.outcome) for e in events] == [
        ("prefix.create", "success"),
        ("prefix.delete", "success"),
    ]
    digest = hashlib.sha256(system.encode()).hexdigest()
    assert events[0].details["after"]["text_sha256"] == digest
    assert events[1].details["before"]["text_sha256"] == digest
    assert events[1].details["before"]["name"] == prefix["name"]
    assert not [e for e in events if "concierge" in json.dumps(e.details)]


def test_refusals_are_typed_and_audited(gateway: Gateway, admin: httpx.Client) -> None:
    prefix = _add(admin, _system_prompt())
    try:
        before = gateway.last_audit_seq()
        again = admin.post(
            "/prefixes",
            json={"namespace": "default", "name": prefix["name"], "text": "Another text."},
        )
        assert again.status_code == 409
        bad_name = admin.post(
            "/prefixes", json={"namespace": "no spaces", "name": "x", "text": "t"}
        )
        assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "namespace"
        missing = admin.patch(f"/prefixes/{uuid.uuid4()}", json={"enabled": False})
        assert missing.status_code == 404
        assert admin.patch(f"/prefixes/{prefix['id']}", json={"enabled": "no"}).status_code == 400
        assert admin.get("/prefixes/not-a-uuid").status_code == 400
        events = [e for e in gateway.audit_events(before) if e.action.startswith("prefix.")]
        assert [(e.action, e.outcome) for e in events] == [
            ("prefix.create", "failure"),
            ("prefix.create", "failure"),
            ("prefix.disable", "failure"),
        ]
    finally:
        admin.delete(f"/prefixes/{prefix['id']}")


def test_a_tenant_admin_may_not_touch_public_prefixes(
    gateway: Gateway, admin: httpx.Client
) -> None:
    prefix = _add(admin, _system_prompt())
    try:
        with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as tenant_admin:
            body = {"namespace": "default", "name": "mine", "text": "Shared by me."}
            for answer in (
                tenant_admin.get("/prefixes"),
                tenant_admin.post("/prefixes", json=body),
                tenant_admin.get(f"/prefixes/{prefix['id']}"),
                tenant_admin.patch(f"/prefixes/{prefix['id']}", json={"enabled": False}),
                tenant_admin.delete(f"/prefixes/{prefix['id']}"),
            ):
                assert answer.status_code == 403, answer.text
                assert answer.json()["error"]["type"] == "permission_error"
        assert admin.get(f"/prefixes/{prefix['id']}").json()["enabled"] is True
    finally:
        admin.delete(f"/prefixes/{prefix['id']}")
