"""Operators' TOTP second factor (PostgreSQL and SQLite): enrolment takes a confirming code,
logins need a current code used only once, `admin`s may be required to have one, and the
secret is stored encrypted under the deployment's key."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pyotp
import pytest

from tenancy import admins, tenants, totp
from tenancy.admins import LoginRefused, SecondFactorRules
from tenancy.errors import Conflict, InvalidInput
from tenancy.models import Admin, utcnow
from tenancy.totp import TotpCipher, UnreadableSecret

PASSWORD = "a long enough password"
CIPHER = TotpCipher.from_secret("key-secret")
RULES = SecondFactorRules(CIPHER)


def _enrolled(store: Any, username: str = "ops") -> str:
    """An operator with a confirmed second factor; its base32 secret."""
    with store.transaction() as session:
        admin = admins.create_admin(session, username, PASSWORD)
        secret = totp.begin_enrolment(session, admin, CIPHER)
        earlier = utcnow() - timedelta(seconds=60)  # leaves the current step unused
        totp.confirm_enrolment(session, admin, pyotp.TOTP(secret).at(earlier), CIPHER, earlier)
    return secret


def _login(store: Any, code: str | None, rules: SecondFactorRules = RULES) -> LoginRefused | None:
    with store.transaction() as session:
        return admins.login(session, "ops", PASSWORD, code, rules).refused


def test_enrolment_needs_a_confirming_code_and_then_logins_need_one(store: Any) -> None:
    with store.transaction() as session:
        admin = admins.create_admin(session, "ops", PASSWORD)
        secret = totp.begin_enrolment(session, admin, CIPHER)
        assert "otpauth://totp/PrefixGate:ops?secret=" in totp.provisioning_uri(secret, "ops")
        with pytest.raises(InvalidInput):
            totp.confirm_enrolment(session, admin, "000000", CIPHER)
        assert admin.totp_secret is None  # a wrong code enrols nothing
    assert _login(store, None) is None  # pending only: the password still suffices
    with store.transaction() as session:
        admin = admins.find_admin(session, "ops")
        earlier = utcnow() - timedelta(seconds=60)
        totp.confirm_enrolment(session, admin, pyotp.TOTP(secret).at(earlier), CIPHER, earlier)
        with pytest.raises(Conflict):
            totp.begin_enrolment(session, admin, CIPHER)
    assert _login(store, None) is LoginRefused.MISSING_CODE
    assert _login(store, "123456" if pyotp.TOTP(secret).now() != "123456" else "654321") is (
        LoginRefused.WRONG_CODE
    )
    assert _login(store, pyotp.TOTP(secret).now()) is None


def test_a_code_is_accepted_once(store: Any) -> None:
    secret = _enrolled(store)
    code = pyotp.TOTP(secret).now()
    assert _login(store, code) is None
    assert _login(store, code) is LoginRefused.REUSED_CODE
    for refused in (LoginRefused.MISSING_CODE, LoginRefused.WRONG_CODE, LoginRefused.REUSED_CODE):
        assert refused.is_failed_guess  # answered like a wrong password


def test_a_code_with_non_ascii_characters_is_a_wrong_code_not_a_crash(store: Any) -> None:
    _enrolled(store)
    full_width_digits = "".join(chr(0xFF11 + n) for n in range(6))  # what a phone may type
    assert _login(store, full_width_digits) is LoginRefused.WRONG_CODE


def test_a_wrong_password_with_the_right_code_does_not_use_the_code(store: Any) -> None:
    secret = _enrolled(store)
    code = pyotp.TOTP(secret).now()
    with store.transaction() as session:
        wrong = admins.login(session, "ops", "not the password", code, RULES).refused
    assert wrong is LoginRefused.WRONG_PASSWORD
    assert _login(store, code) is None


def test_admins_must_have_a_second_factor_where_required_and_tenant_admins_need_not(
    store: Any,
) -> None:
    required = SecondFactorRules(CIPHER, required_for_admins=True)
    with store.transaction() as session:
        admins.create_admin(session, "ops", PASSWORD)
        tenant = tenants.create_tenant(session, "acme")
        admins.create_admin(session, "acme-ops", PASSWORD, "tenant-admin", tenant.id)
        bound = admins.login(session, "acme-ops", PASSWORD, None, required)
        assert bound.admin is not None
        wrong = admins.login(session, "ops", "not the password", None, required).refused
        assert wrong is LoginRefused.WRONG_PASSWORD  # the requirement confirms no password
    assert _login(store, None, required) is LoginRefused.SECOND_FACTOR_NOT_ENROLLED
    assert not LoginRefused.SECOND_FACTOR_NOT_ENROLLED.is_failed_guess


def test_the_secret_is_encrypted_at_rest_under_the_deployment_key(store: Any) -> None:
    secret = _enrolled(store)
    with store.transaction() as session:
        stored = admins.find_admin(session, "ops").totp_secret
    assert stored is not None and secret not in stored
    assert CIPHER.decrypt(stored) == secret
    with pytest.raises(UnreadableSecret):
        TotpCipher.from_secret("another deployment").decrypt(stored)


def test_removing_the_second_factor_lets_the_password_alone_in_again(store: Any) -> None:
    _enrolled(store)
    with store.transaction() as session:
        assert totp.remove(session, admins.find_admin(session, "ops")) is True
        assert totp.remove(session, admins.find_admin(session, "ops")) is False
        assert session.get(Admin, admins.find_admin(session, "ops").id).totp_last_step is None
    assert _login(store, None) is None


def test_a_secret_kept_under_another_deployment_key_refuses_codes_and_says_how_to_fix(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret = _enrolled(store)
    restored = SecondFactorRules(TotpCipher.from_secret("another deployment"))
    assert _login(store, pyotp.TOTP(secret).now(), restored) is LoginRefused.WRONG_CODE
    assert "prefixgate admins reset-totp ops" in caplog.text
