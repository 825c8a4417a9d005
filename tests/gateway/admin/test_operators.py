"""/admin/api/operators: an admin creates, lists and disables operators and sets passwords;
disabling or a new password ends sessions at once; one enabled admin always remains; an
operator may change its own password and nothing else; passwords never reach the audit log.

These tests disable the root account, so they run on a gateway of their own.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client, login
from tests.support.gateway import ADMIN_USER, Gateway, start_gateway

PASSWORD = "a long enough operator password"


@pytest.fixture(scope="module")
def operators_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state_dir = tmp_path_factory.mktemp("operators-state")
    tenants = [("acme", "user", TenantLimits()), ("globex", "user", TenantLimits())]
    with start_gateway(
        migrated_template,
        tiny_chat_dir,
        state_dir,
        tenants,
        admin_login_attempts_per_minute=1000,  # these tests log in often, all from one address
    ) as started:
        yield started


def _create(admin: httpx.Client, role: str = "admin", **fields: object) -> dict[str, Any]:
    body = {"username": f"op-{uuid.uuid4().hex[:8]}", "password": PASSWORD, "role": role}
    answer = admin.post("/operators", json={**body, **fields})
    assert answer.status_code == 201, answer.text
    operator: dict[str, Any] = answer.json()
    return operator


def _tenant_id(gateway: Gateway, slug: str) -> str:
    with admin_client(gateway) as admin:
        rows = admin.get("/tenants", params={"q": slug}).json()["data"]
    return str(next(row["id"] for row in rows if row["slug"] == slug))


def _works(gateway: Gateway, token: str) -> bool:
    status = httpx.get(f"{gateway.admin_url}/me", headers={"Authorization": f"Bearer {token}"})
    assert status.status_code in (200, 401), status.text
    return status.status_code == 200


def test_admin_creates_lists_and_disables_an_operator(operators_gateway: Gateway) -> None:
    gateway = operators_gateway
    before = gateway.last_audit_seq()
    with admin_client(gateway) as admin:
        operator = _create(admin)
        assert operator["role"] == "admin" and operator["disabled"] is False
        listed = admin.get("/operators").json()
        assert operator["id"] in [row["id"] for row in listed]
        assert "password" not in json.dumps(listed)
        token = login(gateway, operator["username"], PASSWORD)
        assert _works(gateway, token)
        disabled = admin.patch(f"/operators/{operator['id']}", json={"disabled": True})
        assert disabled.status_code == 200 and disabled.json()["disabled"] is True
        assert not _works(gateway, token)  # its session ended with the answer
        refused = httpx.post(
            f"{gateway.admin_url}/login",
            json={"username": operator["username"], "password": PASSWORD},
        )
        assert refused.status_code == 403
        enabled = admin.patch(f"/operators/{operator['id']}", json={"disabled": False})
        assert enabled.status_code == 200
        assert _works(gateway, login(gateway, operator["username"], PASSWORD))
    events = [e for e in gateway.audit_events(before) if e.action.startswith("operator.")]
    assert [(e.action, e.outcome) for e in events] == [
        ("operator.create", "success"),
        ("operator.disable", "success"),
        ("operator.enable", "success"),
    ]
    assert events[1].details["before"]["disabled"] is False
    assert events[1].details["after"]["disabled"] is True
    assert not [e for e in events if PASSWORD in json.dumps(e.details)]


def test_the_last_enabled_admin_cannot_be_disabled(operators_gateway: Gateway) -> None:
    gateway = operators_gateway
    with admin_client(gateway) as root:
        operators = root.get("/operators").json()
        root_id = next(row["id"] for row in operators if row["username"] == ADMIN_USER)
        others = [
            row
            for row in operators
            if row["role"] == "admin" and not row["disabled"] and row["id"] != root_id
        ]
        for other in others:  # leave root the only enabled admin
            assert root.patch(f"/operators/{other['id']}", json={"disabled": True}).is_success
        refused = root.patch(f"/operators/{root_id}", json={"disabled": True})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "conflict"
        deputy = _create(root)
    with admin_client(gateway, login(gateway, deputy["username"], PASSWORD)) as client:
        assert client.patch(f"/operators/{root_id}", json={"disabled": True}).status_code == 200
        assert (
            client.patch(f"/operators/{deputy['id']}", json={"disabled": True}).status_code == 409
        )
        assert client.patch(f"/operators/{root_id}", json={"disabled": False}).status_code == 200
    assert _works(gateway, login(gateway))


def test_a_password_change_ends_the_accounts_other_sessions(operators_gateway: Gateway) -> None:
    gateway = operators_gateway
    with admin_client(gateway) as admin:
        operator = _create(admin)
    first = login(gateway, operator["username"], PASSWORD)
    second = login(gateway, operator["username"], PASSWORD)
    new_password = "another long enough password"
    with admin_client(gateway, first) as client:
        path = f"/operators/{operator['id']}/password"
        for current in (None, "not the current password"):  # an unattended session cannot
            refused = client.post(
                path, json={"password": new_password, "current_password": current}
            )
            # A 400 coded like a failed login, never the 401 of a bad session token.
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["param"], error["code"]) == ("current_password", "invalid_credentials")
        answer = client.post(path, json={"password": new_password, "current_password": PASSWORD})
        assert answer.status_code == 204, answer.text
    assert _works(gateway, first)  # the session that changed it goes on
    assert not _works(gateway, second)
    wrong = httpx.post(
        f"{gateway.admin_url}/login", json={"username": operator["username"], "password": PASSWORD}
    )
    assert wrong.status_code == 401
    third = login(gateway, operator["username"], new_password)
    with admin_client(gateway) as admin:  # an admin sets it: every session of it ends
        answer = admin.post(f"/operators/{operator['id']}/password", json={"password": PASSWORD})
        assert answer.status_code == 204
        short = admin.post(f"/operators/{operator['id']}/password", json={"password": "short"})
        assert short.status_code == 400 and short.json()["error"]["param"] == "password"
    assert not _works(gateway, first) and not _works(gateway, third)
    events = [e for e in gateway.audit_events() if e.action == "operator.set_password"]
    assert not [e for e in events if new_password in json.dumps(e.details)]


def test_a_tenant_admin_changes_its_own_password_and_nothing_else(
    operators_gateway: Gateway,
) -> None:
    gateway = operators_gateway
    acme = _tenant_id(gateway, "acme")
    with admin_client(gateway) as admin:
        operator = _create(admin, "tenant-admin", tenant_id=acme)
        assert operator["tenant_id"] == acme
        other = _create(admin)
    with admin_client(gateway, login(gateway, operator["username"], PASSWORD)) as client:
        own = client.post(
            f"/operators/{operator['id']}/password",
            json={"password": "my own new password", "current_password": PASSWORD},
        )
        assert own.status_code == 204
        for answer in (
            client.get("/operators"),
            client.post("/operators", json={"username": "x", "password": PASSWORD}),
            client.patch(f"/operators/{other['id']}", json={"disabled": True}),
            client.post(f"/operators/{other['id']}/password", json={"password": PASSWORD}),
        ):
            assert answer.status_code == 403, answer.text
    with admin_client(gateway, gateway.tenant_admin_keys["acme"]) as key_client:
        answer = key_client.post(
            f"/operators/{operator['id']}/password", json={"password": PASSWORD}
        )
        assert answer.status_code == 403  # a key is nobody's account


def test_operator_refusals_are_typed(operators_gateway: Gateway) -> None:
    gateway = operators_gateway
    with admin_client(gateway) as admin:
        taken = admin.post(
            "/operators", json={"username": ADMIN_USER, "password": PASSWORD, "role": "admin"}
        )
        assert taken.status_code == 409
        unbound = admin.post(
            "/operators", json={"username": "lonely", "password": PASSWORD, "role": "tenant-admin"}
        )
        assert unbound.status_code == 400 and unbound.json()["error"]["param"] == "tenant_id"
        nowhere = admin.post(
            "/operators",
            json={
                "username": "lost",
                "password": PASSWORD,
                "role": "tenant-admin",
                "tenant_id": str(uuid.uuid4()),
            },
        )
        assert nowhere.status_code == 404
        assert admin.patch(f"/operators/{uuid.uuid4()}", json={"disabled": True}).status_code == 404
        extra = admin.patch(f"/operators/{uuid.uuid4()}", json={"disabled": True, "role": "x"})
        assert extra.status_code == 400
