"""/admin/api/login and /logout: a session token works until logout; every failed login is one
audited event in OpenAI's error shape; wrong passwords lock the account (and it says until
when); attempts are throttled per username and per address; a tenant-admin operator sees its
own tenant only.

On a gateway of its own, behind a trusted proxy so that each test logs in from addresses of
its own (`X-Forwarded-For`): the throttle counts per address, and these tests exhaust it.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.gateway import ADMIN_PASSWORD, ADMIN_USER, Gateway, start_gateway

LOCKOUT_FAILURES = 3
ATTEMPTS_PER_MINUTE = 5
PASSWORD = "a long enough operator password"
_addresses = (f"198.51.100.{n}" for n in itertools.count(1))


@pytest.fixture(scope="module")
def sessions_gateway(
    migrated_template: str, tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state_dir = tmp_path_factory.mktemp("sessions-state")
    with start_gateway(
        migrated_template,
        tiny_chat_dir,
        state_dir,
        [("acme", "user", TenantLimits())],
        trusted_proxies=["127.0.0.1"],
        admin_lockout_failures=LOCKOUT_FAILURES,
        admin_login_attempts_per_minute=ATTEMPTS_PER_MINUTE,
    ) as started:
        yield started


def _login(
    gateway: Gateway, username: str, password: str, address: str | None = None
) -> httpx.Response:
    """One login attempt from `address` (default: an address no other attempt used)."""
    return httpx.post(
        f"{gateway.admin_url}/login",
        json={"username": username, "password": password},
        headers={"X-Forwarded-For": address or next(_addresses)},
    )


@pytest.fixture(scope="module")
def root(sessions_gateway: Gateway) -> Iterator[httpx.Client]:
    """One root session for the module: the throttle counts root's logins too."""
    with admin_client(sessions_gateway, _token(sessions_gateway)) as client:
        yield client


def _token(gateway: Gateway, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
    answer = _login(gateway, username, password)
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["token"]
    return token


def _operator(root: httpx.Client, **fields: object) -> dict[str, str]:
    """A new operator, created through the API (so that root is never locked out)."""
    body = {"username": f"op-{uuid.uuid4().hex[:8]}", "password": PASSWORD, **fields}
    answer = root.post("/operators", json=body)
    assert answer.status_code == 201, answer.text
    operator: dict[str, str] = answer.json()
    return operator


def _me(gateway: Gateway, token: str) -> httpx.Response:
    return httpx.get(f"{gateway.admin_url}/me", headers={"Authorization": f"Bearer {token}"})


def test_a_session_works_until_logout(sessions_gateway: Gateway) -> None:
    gateway = sessions_gateway
    answer = _login(gateway, ADMIN_USER, ADMIN_PASSWORD)
    assert answer.status_code == 200
    body = answer.json()
    assert body["token_type"] == "bearer" and body["operator"]["username"] == ADMIN_USER
    token = body["token"]
    assert _me(gateway, token).json()["role"] == "admin"
    with admin_client(gateway, token) as client:
        assert client.post("/logout").status_code == 204
        after = client.get("/tenants")
    assert after.status_code == 401
    assert after.json()["error"]["code"] == "invalid_admin_token"
    assert _me(gateway, token).status_code == 401


def test_each_wrong_password_is_a_401_and_one_audited_failure(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    operator = _operator(root)
    before = gateway.last_audit_seq()
    for _ in range(LOCKOUT_FAILURES - 1):
        answer = _login(gateway, operator["username"], "not the password at all")
        assert answer.status_code == 401
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error"
    unknown = _login(gateway, f"nobody-{uuid.uuid4().hex[:6]}", "whatever it is")
    assert unknown.status_code == 401
    assert unknown.json()["error"]["message"] == answer.json()["error"]["message"]
    logins = [e for e in gateway.audit_events(before) if e.action == "admin.login"]
    assert [e.outcome for e in logins] == ["failure"] * LOCKOUT_FAILURES
    assert [e.actor_id for e in logins[:-1]] == [operator["username"]] * (LOCKOUT_FAILURES - 1)
    assert all(e.source_ip and e.source_ip.startswith("198.51.100.") for e in logins)
    assert not [e for e in logins if "not the password" in str(e.details)]
    # A right password clears the count: the account is not one failure from a lock.
    assert _login(gateway, operator["username"], PASSWORD).status_code == 200
    assert _login(gateway, operator["username"], "wrong again, once").status_code == 401
    assert _login(gateway, operator["username"], PASSWORD).status_code == 200


def test_wrong_passwords_lock_the_account_and_it_says_until_when(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    operator = _operator(root)
    answers = [
        _login(gateway, operator["username"], "guess number one") for _ in range(LOCKOUT_FAILURES)
    ]
    assert [a.status_code for a in answers] == [401] * (LOCKOUT_FAILURES - 1) + [403]
    locked = _login(gateway, operator["username"], PASSWORD)
    assert locked.status_code == 403
    error = locked.json()["error"]
    assert error["code"] == "account_locked" and error["type"] == "permission_error"
    until = datetime.fromisoformat(error["message"].rsplit("until ", 1)[1])
    assert until.tzinfo is not None and until > datetime.now(until.tzinfo)
    listed = root.get("/operators").json()
    shown = next(row for row in listed if row["id"] == operator["id"])
    assert shown["locked_until"] is not None


def test_logins_are_throttled_per_username_and_per_address(sessions_gateway: Gateway) -> None:
    gateway = sessions_gateway
    username = f"op-{uuid.uuid4().hex[:8]}"  # no such account: the throttle comes first
    for _ in range(ATTEMPTS_PER_MINUTE):
        assert _login(gateway, username, "some password").status_code == 401
    throttled = _login(gateway, username, "some password")
    assert throttled.status_code == 429
    assert throttled.json()["error"]["code"] == "too_many_login_attempts"
    assert 1 <= int(throttled.headers["Retry-After"]) <= 60

    address = next(_addresses)
    for _ in range(ATTEMPTS_PER_MINUTE):
        other = f"op-{uuid.uuid4().hex[:8]}"
        assert _login(gateway, other, "some password", address).status_code == 401
    from_there = _login(gateway, f"op-{uuid.uuid4().hex[:8]}", "some password", address)
    assert from_there.status_code == 429
    assert "Retry-After" in from_there.headers


def test_a_tenant_admin_operator_sees_only_its_tenant(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    own = root.post("/tenants", json={"slug": f"s-{uuid.uuid4().hex[:10]}"}).json()
    listed = root.get("/tenants", params={"limit": 500}).json()["data"]
    others = [row for row in listed if row["id"] != own["id"]]
    assert others  # acme at least
    operator = _operator(root, role="tenant-admin", tenant_id=own["id"])
    token = _token(gateway, operator["username"], PASSWORD)
    assert _me(gateway, token).json() == {
        "role": "tenant-admin",
        "tenant_id": own["id"],
        "actor_type": "operator",
        "actor_id": operator["username"],
    }
    with admin_client(gateway, token) as client:
        assert [row["id"] for row in client.get("/tenants").json()["data"]] == [own["id"]]
        assert client.post(f"/tenants/{own['id']}/keys", json={"name": "ops"}).status_code == 201
        for other in others:
            assert client.get(f"/tenants/{other['id']}").status_code == 404
            assert client.get(f"/tenants/{other['id']}/keys").status_code == 404
        assert client.get("/operators").status_code == 403
