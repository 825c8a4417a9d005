"""/admin/api/login and /logout: a session token works until logout; every failed login is one
audited event; an unknown name, a wrong password and a wrong one-time code get one identical
401 `invalid_credentials`; failures slow down only their own (name, source) pair, so nobody can
lock an operator out from elsewhere; attempts per source are capped; a TOTP second factor is
enrolled with a code, then needed at every login, each code once; a tenant-admin operator sees
its own tenant only.

On a gateway of its own, behind a trusted proxy so that each test logs in from addresses of
its own (`X-Forwarded-For`).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyotp
import pytest
from sqlalchemy.orm import Session

from tenancy import admins, totp
from tenancy.db import make_engine
from tenancy.tenants import TenantLimits
from tests.support.admin import admin_client
from tests.support.gateway import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    KEY_SECRET,
    Gateway,
    start_gateway,
)

FREE_FAILURES = 3
ATTEMPTS_PER_MINUTE = 8
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
        admin_login_free_failures=FREE_FAILURES,
        admin_login_max_delay_s=600,
        admin_login_attempts_per_minute=ATTEMPTS_PER_MINUTE,
    ) as started:
        yield started


def _login(
    gateway: Gateway,
    username: str,
    password: str,
    address: str | None = None,
    code: str | None = None,
) -> httpx.Response:
    """One login attempt from `address` (default: an address no other attempt used)."""
    body = {"username": username, "password": password}
    if code is not None:
        body["totp_code"] = code
    return httpx.post(
        f"{gateway.admin_url}/login",
        json=body,
        headers={"X-Forwarded-For": address or next(_addresses)},
    )


@pytest.fixture(scope="module")
def root(sessions_gateway: Gateway) -> Iterator[httpx.Client]:
    """One root session for the module."""
    with admin_client(sessions_gateway, _token(sessions_gateway)) as client:
        yield client


def _token(gateway: Gateway, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
    answer = _login(gateway, username, password)
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["token"]
    return token


def _operator(root: httpx.Client, **fields: object) -> dict[str, str]:
    """A new operator, created through the API."""
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


def test_unknown_names_wrong_passwords_and_wrong_codes_get_one_identical_401(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    operator = _operator(root)
    before = gateway.last_audit_seq()
    wrong = _login(gateway, operator["username"], "not the password at all")
    unknown = _login(gateway, f"nobody-{uuid.uuid4().hex[:6]}", "not the password at all")
    with_code = _login(gateway, operator["username"], "not the password at all", code="123456")
    for answer in (wrong, unknown, with_code):
        assert answer.status_code == 401
        assert answer.json() == wrong.json()
        assert "retry-after" not in answer.headers
    error = wrong.json()["error"]
    assert error["code"] == "invalid_credentials" and error["type"] == "authentication_error"
    logins = [e for e in gateway.audit_events(before) if e.action == "admin.login"]
    assert [(e.outcome, e.details["reason"]) for e in logins] == [
        ("failure", "wrong_password"), ("failure", "unknown_operator"),
        ("failure", "wrong_password"),
    ]  # fmt: skip
    assert all(e.source_ip and e.source_ip.startswith("198.51.100.") for e in logins)
    assert not [e for e in logins if "not the password" in str(e.details)]


def test_an_unknown_name_costs_what_a_wrong_password_does(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    """A login must not tell by its time whether a name exists: an unknown name is checked
    against a stand-in hash, as slow as a real one. Without it the unknown name answers in
    a few milliseconds against the tens to hundreds an argon2 check takes, far outside the
    factor of two allowed here for a shared machine's noise."""
    gateway = sessions_gateway
    name = _operator(root)["username"]
    timings: dict[str, list[float]] = {"wrong": [], "unknown": []}
    for n in range(7):  # interleaved, so that a busy moment slows both alike
        for kind, username in (("wrong", name), ("unknown", f"nobody-{uuid.uuid4().hex[:8]}")):
            started = time.perf_counter()
            answer = _login(gateway, username, f"a wrong password {n:04d}")
            timings[kind].append(time.perf_counter() - started)
            assert answer.status_code == 401
    wrong, unknown = (statistics.median(timings[kind]) for kind in ("wrong", "unknown"))
    assert 0.5 < unknown / wrong < 2, timings


def test_an_anonymous_caller_cannot_lock_the_admin_out(sessions_gateway: Gateway) -> None:
    gateway = sessions_gateway
    attacker = next(_addresses)
    answers = [_login(gateway, ADMIN_USER, f"guess {n:04d} of many", attacker) for n in range(6)]
    statuses = [answer.status_code for answer in answers]
    assert statuses == [401] * FREE_FAILURES + [429] * (6 - FREE_FAILURES)
    # Many more attackers, each to its own limit: none of it reaches the admin's own address.
    for _ in range(4):
        source = next(_addresses)
        for n in range(FREE_FAILURES + 1):
            _login(gateway, ADMIN_USER, f"another guess {n:04d}", source)
    assert _login(gateway, ADMIN_USER, ADMIN_PASSWORD).status_code == 200


def test_a_waiting_pair_gets_the_same_429_for_a_known_and_an_unknown_name(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    source = next(_addresses)
    known, unknown = _operator(root)["username"], f"nobody-{uuid.uuid4().hex[:6]}"
    answers = {}
    for name in (known, unknown):
        for n in range(FREE_FAILURES):
            assert _login(gateway, name, f"wrong guess {n:04d}", source).status_code == 401
        answers[name] = _login(gateway, name, "one more wrong guess", source)
    assert answers[known].status_code == answers[unknown].status_code == 429
    assert answers[known].json() == answers[unknown].json()
    assert answers[known].json()["error"]["code"] == "too_many_login_attempts"
    assert 1 <= int(answers[known].headers["Retry-After"]) <= 1 + 600
    # From another source the name is like any other: a wrong password is the plain 401.
    elsewhere = _login(gateway, known, "wrong from elsewhere")
    assert elsewhere.status_code == 401
    assert elsewhere.json()["error"]["code"] == "invalid_credentials"


def test_the_wait_grows_with_each_failure(sessions_gateway: Gateway, root: httpx.Client) -> None:
    gateway = sessions_gateway
    source, name = next(_addresses), _operator(root)["username"]
    waits = []
    for n in range(FREE_FAILURES + 2):
        answer = _login(gateway, name, f"wrong guess {n:04d}", source)
        if answer.status_code == 429:  # wait its turn, then fail again
            waits.append(int(answer.headers["Retry-After"]))
            time.sleep(int(answer.headers["Retry-After"]))
            assert _login(gateway, name, f"retried guess {n:04d}", source).status_code == 401
    assert waits == [1, 2]


def test_attempts_are_capped_per_source_whatever_the_names(sessions_gateway: Gateway) -> None:
    gateway = sessions_gateway
    address = next(_addresses)
    for _ in range(ATTEMPTS_PER_MINUTE):
        other = f"op-{uuid.uuid4().hex[:8]}"
        assert _login(gateway, other, "some password", address).status_code == 401
    from_there = _login(gateway, f"op-{uuid.uuid4().hex[:8]}", "some password", address)
    assert from_there.status_code == 429
    assert from_there.json()["error"]["code"] == "too_many_login_attempts"
    assert "Retry-After" in from_there.headers
    assert _login(gateway, ADMIN_USER, ADMIN_PASSWORD).status_code == 200


def test_correct_logins_do_not_use_up_their_sources_limit(sessions_gateway: Gateway) -> None:
    # Behind one shared address (a NAT, an untrusted proxy) colleagues log in all day: only
    # failures count toward the address's limit, so a guesser there cannot crowd them out.
    gateway, shared = sessions_gateway, next(_addresses)
    for _ in range(ATTEMPTS_PER_MINUTE + 2):
        assert _login(gateway, ADMIN_USER, ADMIN_PASSWORD, shared).status_code == 200
    for n in range(ATTEMPTS_PER_MINUTE - 1):  # a guesser's failures, across many names
        _login(gateway, f"op-{uuid.uuid4().hex[:8]}", f"guess {n:04d}", shared)
    assert _login(gateway, ADMIN_USER, ADMIN_PASSWORD, shared).status_code == 200
    # The failures alone fill the limit (the address is the limit's whole key: a trusted
    # proxy's forwarded address tells colleagues apart; the gateway warns of an untrusted one).
    assert _login(gateway, "op-someone", "the last free guess", shared).status_code == 401
    assert _login(gateway, "op-someone", "one guess too many", shared).status_code == 429


def test_a_second_factor_is_enrolled_with_a_code_and_each_code_works_once(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    operator = _operator(root)
    name = operator["username"]
    before = gateway.last_audit_seq()
    with admin_client(gateway, _token(gateway, name, PASSWORD)) as own:
        begun = own.post("/operators/me/totp")
        assert begun.status_code == 200, begun.text
        secret = begun.json()["secret"]
        assert begun.json()["otpauth_uri"].startswith("otpauth://totp/PrefixGate:")
        earlier = pyotp.TOTP(secret).at(time.time() - 30)  # leaves the current code unused
        wrong_code = {"password": PASSWORD, "code": "000000" if earlier != "000000" else "1"}
        assert own.post("/operators/me/totp/confirm", json=wrong_code).status_code == 400
        # A session alone cannot add a second factor: the password must come with the code.
        stolen = own.post("/operators/me/totp/confirm", json={"password": "no", "code": earlier})
        assert (stolen.status_code, stolen.json()["error"]["param"]) == (400, "password")
        assert stolen.json()["error"]["code"] == "invalid_credentials"
        assert own.post("/operators/me/totp/confirm", json={"code": earlier}).status_code == 400
        confirmed = own.post(
            "/operators/me/totp/confirm", json={"password": PASSWORD, "code": earlier}
        )
        assert confirmed.status_code == 204, confirmed.text
    listed = next(row for row in root.get("/operators").json() if row["id"] == operator["id"])
    assert listed["second_factor"] is True
    without = _login(gateway, name, PASSWORD)
    wrong = _login(gateway, name, "not the password at all")
    assert without.status_code == 401 and without.json() == wrong.json()  # no password oracle
    code = pyotp.TOTP(secret).now()
    assert _login(gateway, name, PASSWORD, code=code).status_code == 200
    replayed = _login(gateway, name, PASSWORD, code=code)
    assert replayed.status_code == 401 and replayed.json() == wrong.json()
    events = [(e.action, e.outcome) for e in gateway.audit_events(before)]
    assert ("operator.totp_begin", "success") in events
    assert ("operator.totp_enable", "failure") in events
    assert ("operator.totp_enable", "success") in events
    reasons = [e.details.get("reason") for e in gateway.audit_events(before)]
    assert {"missing_totp_code", "reused_totp_code"} <= set(reasons)
    assert not [e for e in gateway.audit_events(before) if secret in str(e.details)]


def test_removing_a_second_factor_needs_the_password_and_a_code(
    sessions_gateway: Gateway, root: httpx.Client
) -> None:
    gateway = sessions_gateway
    name = _operator(root)["username"]
    with admin_client(gateway, _token(gateway, name, PASSWORD)) as own:
        secret = own.post("/operators/me/totp").json()["secret"]
        earlier = pyotp.TOTP(secret).at(time.time() - 30)
        confirm = {"password": PASSWORD, "code": earlier}
        assert own.post("/operators/me/totp/confirm", json=confirm).status_code == 204
        code = pyotp.TOTP(secret).now()
        refused = own.post(
            "/operators/me/totp/disable", json={"password": "wrong one!", "code": code}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_credentials"
        removed = own.post("/operators/me/totp/disable", json={"password": PASSWORD, "code": code})
        assert removed.status_code == 204, removed.text
    assert _login(gateway, name, PASSWORD).status_code == 200


def test_behind_a_trusted_proxy_no_proxy_warning_is_logged(sessions_gateway: Gateway) -> None:
    assert _login(sessions_gateway, ADMIN_USER, ADMIN_PASSWORD).status_code == 200
    assert sessions_gateway.server.gateway.untrusted_proxy_warned is False


def test_an_untrusted_proxy_is_warned_of_once(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared gateway trusts no proxy: forwarded headers mean one it does not trust."""
    gateway.server.gateway.untrusted_proxy_warned = False
    with caplog.at_level(logging.WARNING, logger="gateway.http.middleware"):
        assert httpx.get(gateway.server.url + "/healthz").status_code == 200
        assert not _proxy_warnings(caplog)  # nothing forwarded: nothing to say
        for header in ("X-Forwarded-For", "Forwarded", "X-Forwarded-For"):
            value = "203.0.113.9" if header == "X-Forwarded-For" else "for=203.0.113.9"
            httpx.get(gateway.server.url + "/healthz", headers={header: value})
    (warning,) = _proxy_warnings(caplog)
    assert "PREFIXGATE_TRUSTED_PROXIES" in warning


def _proxy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "proxy that is not trusted" in r.getMessage()]


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


def test_where_a_second_factor_is_required_an_admin_needs_one_to_log_in(
    migrated_template: str, tiny_chat_dir: Path, tmp_path: Path
) -> None:
    with start_gateway(
        migrated_template,
        tiny_chat_dir,
        tmp_path,
        [("acme", "user", TenantLimits())],
        trusted_proxies=["127.0.0.1"],
        admin_totp_required=True,
    ) as gateway:
        # A wrong password is the plain 401: the requirement confirms nothing to a guesser.
        wrong = _login(gateway, ADMIN_USER, "not the password")
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_credentials")
        refused = _login(gateway, ADMIN_USER, ADMIN_PASSWORD)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "second_factor_required"
        assert f"prefixgate admins enrol-totp {ADMIN_USER}" in error["message"]
        assert "token" not in refused.json()

        # Enrolled on the host (what `prefixgate admins enrol-totp` does), it logs in with a code.
        cipher = totp.TotpCipher.from_secret(KEY_SECRET)
        engine = make_engine(gateway.database_url)
        try:
            with Session(engine) as session, session.begin():
                admin = admins.find_admin(session, ADMIN_USER)
                secret = totp.begin_enrolment(session, admin, cipher)
                totp.confirm_enrolment(session, admin, pyotp.TOTP(secret).now(), cipher)
        finally:
            engine.dispose()
        without_code = _login(gateway, ADMIN_USER, ADMIN_PASSWORD)
        assert without_code.status_code == 401  # now a missing code, like a wrong one
        next_code = pyotp.TOTP(secret).at(time.time() + 30)  # the confirming code is used
        assert _login(gateway, ADMIN_USER, ADMIN_PASSWORD, code=next_code).status_code == 200
