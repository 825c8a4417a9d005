"""Operator accounts for the admin console: passwords (argon2, pwdlib), roles, login lockout.

An `admin` runs every tenant; a `tenant-admin` is bound to one tenant. At least one enabled
`admin` always remains, so nobody can lock every operator out. A login with a wrong password
counts against the account; at the lockout threshold the account refuses every password until
its lock ends, and says so. Unknown usernames cost the same argon2 work as known ones.
"""

from __future__ import annotations

import enum
import re
import unicodedata
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from pwdlib import PasswordHash
from pwdlib.hashers.argon2 import Argon2Hasher
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, aliased

from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.models import OPERATOR_ROLES, Admin, AdminSession, Tenant, utcnow

_HASHER = PasswordHash((Argon2Hasher(),))
_USERNAME = re.compile(r"^[A-Za-z0-9_.@-]{1,100}$")
MIN_PASSWORD_LENGTH = 12
MAX_PASSWORD_LENGTH = 1024  # argon2 takes any length; a megabyte password is only a cost
# Verifying against this keeps timing the same for unknown usernames.
_DUMMY_HASH = _HASHER.hash("prefixgate-timing-equaliser")


class LoginRefused(enum.Enum):
    WRONG_CREDENTIALS = "wrong_credentials"
    LOCKED = "locked"
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class Lockout:
    """After `failures` wrong passwords in a row, the account locks for `duration`."""

    failures: int = 5
    duration: timedelta = timedelta(minutes=15)


@dataclass(frozen=True, slots=True)
class LoginResult:
    admin: Admin | None
    refused: LoginRefused | None = None
    locked_until: datetime | None = None


def check_password(password: str) -> None:
    """Refuse a password too short, too long, blank or holding control characters."""
    if any(ord(character) < 32 or ord(character) == 127 for character in password):
        raise InvalidInput("password must not contain control characters", "password")
    if not password.strip():
        raise InvalidInput("password must not be only spaces", "password")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise InvalidInput(
            f"password must be at least {MIN_PASSWORD_LENGTH} characters", "password"
        )
    if len(password) > MAX_PASSWORD_LENGTH:
        raise InvalidInput(f"password must be at most {MAX_PASSWORD_LENGTH} characters", "password")


def create_admin(
    session: Session,
    username: str,
    password: str,
    role: str = "admin",
    tenant_id: uuid.UUID | None = None,
) -> Admin:
    """Create an operator; a `tenant-admin` names its (live) tenant, an `admin` none."""
    if not _USERNAME.match(username):
        raise InvalidInput("username: 1-100 letters, digits or _ . @ -", "username")
    check_password(password)
    if role not in OPERATOR_ROLES:
        raise InvalidInput(f"role must be one of {', '.join(OPERATOR_ROLES)}", "role")
    if (role == "tenant-admin") != (tenant_id is not None):
        raise InvalidInput("a tenant-admin needs a tenant; an admin has none", "tenant_id")
    if tenant_id is not None:
        tenant = session.get(Tenant, tenant_id)
        if tenant is None or tenant.status == "deleted":
            raise NotFound(f"no tenant with id {tenant_id}")
    # Names differing only in case would be easy to confuse in the audit log.
    same_name = select(Admin.id).where(func.lower(Admin.username) == username.lower())
    if session.scalar(same_name) is not None:
        raise Conflict(f"an operator named {username!r} already exists")
    admin = Admin(
        username=username,
        password_hash=_HASHER.hash(_normalized(password)),
        role=role,
        tenant_id=tenant_id,
        password_changed_at=utcnow(),
    )
    session.add(admin)
    session.flush()
    return admin


def list_admins(session: Session, tenant_id: uuid.UUID | None = None) -> list[Admin]:
    """Every operator (or only those bound to `tenant_id`), by username."""
    query = select(Admin).order_by(Admin.username)
    if tenant_id is not None:
        query = query.where(Admin.tenant_id == tenant_id)
    return list(session.scalars(query))


def get_admin(session: Session, admin_id: uuid.UUID) -> Admin:
    admin = session.get(Admin, admin_id)
    if admin is None:
        raise NotFound(f"no operator with id {admin_id}")
    return admin


def find_admin(session: Session, username: str) -> Admin:
    """An operator by username."""
    admin = session.scalar(select(Admin).where(Admin.username == username))
    if admin is None:
        raise NotFound(f"no operator named {username!r}")
    return admin


def set_disabled(session: Session, admin_id: uuid.UUID, disabled: bool) -> Admin:
    """Disable (every session of it revoked at once) or re-enable an operator (which also
    ends a lockout)."""
    admin = get_admin(session, admin_id)
    if disabled and admin.role == "admin" and not admin.disabled:
        _disable_unless_last_admin(session, admin)
    admin.disabled = disabled
    if disabled:
        revoke_sessions(session, admin.id)
    else:  # re-enabling restores access: a lockout ends too
        admin.failed_logins = 0
        admin.locked_until = None
    session.flush()
    return admin


def change_password(
    session: Session, admin_id: uuid.UUID, password: str, keep_session: str | None = None
) -> Admin:
    """Set a new password, clear any lockout and end every other session of the account."""
    check_password(password)
    admin = get_admin(session, admin_id)
    admin.password_hash = _HASHER.hash(_normalized(password))
    admin.password_changed_at = utcnow()
    admin.failed_logins = 0
    admin.locked_until = None
    revoke_sessions(session, admin.id, keep=keep_session)
    session.flush()
    return admin


def login(
    session: Session, username: str, password: str, lockout: Lockout, now: datetime | None = None
) -> LoginResult:
    """Check a username and password, counting wrong passwords towards the account's lockout."""
    now = now or utcnow()
    password = _normalized(password[:MAX_PASSWORD_LENGTH])
    admin = session.scalar(select(Admin).where(Admin.username == username))
    if admin is None:
        _HASHER.verify(password, _DUMMY_HASH)
        return LoginResult(None, LoginRefused.WRONG_CREDENTIALS)
    locked_until = admin.locked_until
    if locked_until is not None and locked_until > now:
        _HASHER.verify(password, _DUMMY_HASH)  # same work whether locked or not
        return LoginResult(None, LoginRefused.LOCKED, locked_until)
    if not _HASHER.verify(password, admin.password_hash):
        # One atomic increment: guesses sent at the same moment each count.
        failures = session.execute(
            update(Admin)
            .where(Admin.id == admin.id)
            .values(failed_logins=Admin.failed_logins + 1)
            .returning(Admin.failed_logins)
            .execution_options(synchronize_session=False)
        ).scalar_one()
        if failures >= lockout.failures:
            until = now + lockout.duration
            session.execute(
                update(Admin)
                .where(Admin.id == admin.id)
                .values(failed_logins=0, locked_until=until)
                .execution_options(synchronize_session=False)
            )
            return LoginResult(None, LoginRefused.LOCKED, until)
        return LoginResult(None, LoginRefused.WRONG_CREDENTIALS)
    if admin.disabled or not _tenant_active(session, admin):
        return LoginResult(None, LoginRefused.DISABLED)
    admin.failed_logins = 0
    admin.locked_until = None
    session.flush()
    return LoginResult(admin)


# -- sessions ---------------------------------------------------------------------------------


def open_session(session: Session, admin: Admin, jti: str, expires_at: datetime) -> AdminSession:
    """Remember an issued token so that it can be revoked before it expires."""
    now = utcnow()
    # Expired sessions are kept a day for the record, then swept as new ones open.
    expired = delete(AdminSession).where(AdminSession.expires_at < now - timedelta(days=1))
    session.execute(expired)
    row = AdminSession(jti=jti, admin_id=admin.id, issued_at=now, expires_at=expires_at)
    session.add(row)
    session.flush()
    return row


def active_session(session: Session, jti: str, now: datetime | None = None) -> Admin | None:
    """The enabled operator behind a token id that is neither revoked nor expired, else None."""
    now = now or utcnow()
    row = session.execute(
        select(AdminSession, Admin)
        .join(Admin, Admin.id == AdminSession.admin_id)
        .where(AdminSession.jti == jti)
    ).first()
    if row is None:
        return None
    admin_session, admin = row
    if admin_session.revoked_at is not None or admin_session.expires_at <= now:
        return None
    if admin.disabled or not _tenant_active(session, admin):
        return None
    return admin


def revoke_session(session: Session, jti: str) -> None:
    session.execute(
        update(AdminSession)
        .where(AdminSession.jti == jti, AdminSession.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )


def revoke_sessions(session: Session, admin_id: uuid.UUID, keep: str | None = None) -> None:
    query = update(AdminSession).where(
        AdminSession.admin_id == admin_id, AdminSession.revoked_at.is_(None)
    )
    if keep is not None:
        query = query.where(AdminSession.jti != keep)
    session.execute(query.values(revoked_at=utcnow()))


def _tenant_active(session: Session, admin: Admin) -> bool:
    """An admin has no tenant; a tenant-admin works only while its tenant is active."""
    if admin.tenant_id is None:
        return True
    tenant = session.get(Tenant, admin.tenant_id)
    return tenant is not None and tenant.status == "active"


def _disable_unless_last_admin(session: Session, leaving: Admin) -> None:
    """Disable an enabled admin unless no other enabled admin would remain.

    Two admins disabling each other at the same moment must not both succeed: on PostgreSQL
    the enabled admins' rows are locked (in id order) before counting; the UPDATE itself
    repeats the count, which makes it one atomic statement on SQLite's single writer.
    """
    enabled = (Admin.role == "admin") & Admin.disabled.is_(False)
    session.execute(select(Admin.id).where(enabled).order_by(Admin.id).with_for_update())
    other = aliased(Admin)
    others = (
        select(func.count())
        .select_from(other)
        .where(other.role == "admin", other.disabled.is_(False), other.id != leaving.id)
        .scalar_subquery()
    )
    result = session.execute(
        update(Admin)
        .where(Admin.id == leaving.id, others > 0)
        .values(disabled=True)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise Conflict("at least one enabled admin must remain")
    session.refresh(leaving)


def _normalized(password: str) -> str:
    """NFKC, so that a password typed on another keyboard or system hashes the same."""
    return unicodedata.normalize("NFKC", password)
