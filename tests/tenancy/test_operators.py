"""Operator accounts: roles, the last admin, why a login is refused, and sessions (PostgreSQL
and SQLite). No account ever locks: failures count per (name, source) pair
(tests/tenancy/test_login_failures.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from tenancy import admins, tenants
from tenancy.admins import LoginRefused, SecondFactorRules
from tenancy.errors import Conflict, InvalidInput
from tenancy.models import utcnow
from tenancy.totp import TotpCipher

PASSWORD = "a long enough password"
RULES = SecondFactorRules(TotpCipher.from_secret("key-secret"))


def test_the_last_enabled_admin_cannot_be_disabled(store: Any) -> None:
    with store.transaction() as session:
        first = admins.create_admin(session, "first", PASSWORD)
        second = admins.create_admin(session, "second", PASSWORD)
        admins.set_disabled(session, first.id, True)
        with pytest.raises(Conflict, match="at least one enabled admin"):
            admins.set_disabled(session, second.id, True)
        assert not second.disabled


def test_tenant_admin_operators_need_exactly_one_tenant(store: Any) -> None:
    with store.transaction() as session:
        tenant = tenants.create_tenant(session, "acme")
        with pytest.raises(InvalidInput):
            admins.create_admin(session, "lost", PASSWORD, role="tenant-admin")
        with pytest.raises(InvalidInput):
            admins.create_admin(session, "both", PASSWORD, role="admin", tenant_id=tenant.id)
        bound = admins.create_admin(session, "acme-ops", PASSWORD, "tenant-admin", tenant.id)
        assert (bound.role, bound.tenant_id) == ("tenant-admin", tenant.id)


def test_wrong_passwords_never_lock_the_account(store: Any) -> None:
    with store.transaction() as session:
        admins.create_admin(session, "ops", PASSWORD)
    for _ in range(20):
        with store.transaction() as session:
            refused = admins.login(session, "ops", "wrong password!!", None, RULES).refused
            assert refused is LoginRefused.WRONG_PASSWORD
    with store.transaction() as session:
        assert admins.login(session, "ops", PASSWORD, None, RULES).admin is not None


def test_a_refusal_says_why_and_only_right_credentials_learn_that_an_account_is_disabled(
    store: Any,
) -> None:
    with store.transaction() as session:
        admins.create_admin(session, "keep", PASSWORD)
        ops = admins.create_admin(session, "ops", PASSWORD)
        admins.set_disabled(session, ops.id, True)
        unknown = admins.login(session, "nobody", PASSWORD, None, RULES).refused
        wrong = admins.login(session, "ops", "wrong password!!", None, RULES).refused
        right = admins.login(session, "ops", PASSWORD, None, RULES).refused
    assert (unknown, wrong, right) == (
        LoginRefused.UNKNOWN_OPERATOR, LoginRefused.WRONG_PASSWORD, LoginRefused.DISABLED
    )  # fmt: skip
    assert (
        LoginRefused.UNKNOWN_OPERATOR.is_failed_guess
        and LoginRefused.WRONG_PASSWORD.is_failed_guess
    )
    assert not LoginRefused.DISABLED.is_failed_guess


def test_disabling_or_a_new_password_ends_sessions(store: Any) -> None:
    with store.transaction() as session:
        admins.create_admin(session, "keep", PASSWORD)
        ops = admins.create_admin(session, "ops", PASSWORD)
        expires = utcnow() + timedelta(minutes=15)
        admins.open_session(session, ops, "current", expires)
        admins.open_session(session, ops, "other", expires)
        admins.change_password(session, ops.id, "another long password", keep_session="current")
        assert admins.active_session(session, "current") is not None
        assert admins.active_session(session, "other") is None
        admins.set_disabled(session, ops.id, True)
        assert admins.active_session(session, "current") is None


def test_an_expired_session_is_not_active(store: Any) -> None:
    with store.transaction() as session:
        ops = admins.create_admin(session, "ops", PASSWORD)
        admins.open_session(session, ops, "old", utcnow() + timedelta(seconds=1))
        assert admins.active_session(session, "old", now=utcnow() + timedelta(seconds=2)) is None


def test_two_admins_disabling_each_other_at_once_leave_one_enabled(store: Any) -> None:
    with store.transaction() as session:
        first = admins.create_admin(session, "first", PASSWORD).id
        second = admins.create_admin(session, "second", PASSWORD).id
    for _ in range(3):
        barrier = threading.Barrier(2)

        def disable(admin_id: Any, barrier: threading.Barrier = barrier) -> str:
            barrier.wait()
            try:
                with store.transaction() as session:
                    admins.set_disabled(session, admin_id, True)
            except Conflict:
                return "refused"
            return "disabled"

        with ThreadPoolExecutor(2) as pool:
            outcomes = sorted(pool.map(disable, (first, second)))
        assert outcomes == ["disabled", "refused"]
        with store.transaction() as session:
            enabled = [a.username for a in admins.list_admins(session) if not a.disabled]
            assert len(enabled) == 1
            for admin_id in (first, second):  # and again, from two enabled admins
                admins.set_disabled(session, admin_id, False)


def test_passwords_are_normalised_and_blank_or_control_ones_refused(store: Any) -> None:
    composed, decomposed = "p\u00e4ssw\u00f6rd-unicode-1", "pa\u0308ssw\u00f6rd-unicode-1"
    with store.transaction() as session:
        admins.create_admin(session, "ops", composed)
        assert admins.login(session, "ops", decomposed, None, RULES).admin is not None
        for bad in (" " * 12, "\x00" * 12, "tab\tinside-password"):
            with pytest.raises(InvalidInput):
                admins.create_admin(session, "other", bad)
        with pytest.raises(Conflict):
            admins.create_admin(session, "OPS", PASSWORD)


def test_a_tenant_admin_of_a_suspended_tenant_cannot_log_in_or_keep_its_session(
    store: Any,
) -> None:
    with store.transaction() as session:
        tenant = tenants.create_tenant(session, "acme")
        ops = admins.create_admin(session, "acme-ops", PASSWORD, "tenant-admin", tenant.id)
        admins.open_session(session, ops, "live", utcnow() + timedelta(minutes=5))
        tenants.set_status(session, "acme", "suspended")
        assert admins.active_session(session, "live") is None
        refused = admins.login(session, "acme-ops", PASSWORD, None, RULES).refused
        assert refused is LoginRefused.DISABLED
