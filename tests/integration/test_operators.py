"""Operator accounts: roles, the last admin, lockout and sessions (PostgreSQL and SQLite)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tenancy import admins, tenants
from tenancy.admins import Lockout, LoginRefused
from tenancy.errors import Conflict, InvalidInput
from tenancy.models import utcnow

PASSWORD = "a long enough password"


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


def test_wrong_passwords_lock_the_account_even_for_the_right_one(store: Any) -> None:
    lockout = Lockout(failures=3, duration=timedelta(minutes=5))
    with store.transaction() as session:
        admins.create_admin(session, "ops", PASSWORD)
    for _ in range(2):
        with store.transaction() as session:
            refused = admins.login(session, "ops", "wrong password!!", lockout).refused
            assert refused is LoginRefused.WRONG_CREDENTIALS
    with store.transaction() as session:
        third = admins.login(session, "ops", "wrong password!!", lockout)
        assert third.refused is LoginRefused.LOCKED
    with store.transaction() as session:
        right = admins.login(session, "ops", PASSWORD, lockout)
        assert right.refused is LoginRefused.LOCKED
        assert right.locked_until is not None and right.locked_until > utcnow()
    later = utcnow() + timedelta(minutes=6)
    with store.transaction() as session:
        assert admins.login(session, "ops", PASSWORD, lockout, now=later).admin is not None


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
