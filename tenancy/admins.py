"""Operator accounts for the admin console: passwords (argon2, pwdlib), roles, login lockout.

An `admin` runs every tenant; a `tenant-admin` is bound to one tenant. At least one enabled
`admin` always remains, so nobody can lock every operator out. A login with a wrong password
counts against the account; at the lockout threshold the account refuses every password until
its lock ends, and says so. Unknown usernames cost the same argon2 work as known ones.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pwdlib import PasswordHash
from pwdlib.hashers.argon2 import Argon2Hasher
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

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
    if session.scalar(select(Admin.id).where(Admin.username == username)) is not None:
        raise Conflict(f"an operator named {username!r} already exists")
    admin = Admin(
        username=username,
        password_hash=_HASHER.hash(password),
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
    """Disable (every session of it revoked at once) or re-enable an operator."""
    admin = get_admin(session, admin_id)
    if disabled and admin.role == "admin" and not admin.disabled:
        _keep_one_admin(session, admin)
    admin.disabled = disabled
    if disabled:
        revoke_sessions(session, admin.id)
    session.flush()
    return admin


def change_password(
    session: Session, admin_id: uuid.UUID, password: str, keep_session: str | None = None
) -> Admin:
    """Set a new password, clear any lockout and end every other session of the account."""
    check_password(password)
    admin = get_admin(session, admin_id)
    admin.password_hash = _HASHER.hash(password)
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
    password = password[:MAX_PASSWORD_LENGTH]
    admin = session.scalar(select(Admin).where(Admin.username == username))
    if admin is None:
        _HASHER.verify(password, _DUMMY_HASH)
        return LoginResult(None, LoginRefused.WRONG_CREDENTIALS)
    locked_until = _aware(admin.locked_until)
    if locked_until is not None and locked_until > now:
        _HASHER.verify(password, _DUMMY_HASH)  # same work whether locked or not
        return LoginResult(None, LoginRefused.LOCKED, locked_until)
    if not _HASHER.verify(password, admin.password_hash):
        admin.failed_logins += 1
        if admin.failed_logins >= lockout.failures:
            admin.failed_logins = 0
            admin.locked_until = now + lockout.duration
            session.flush()
            return LoginResult(None, LoginRefused.LOCKED, admin.locked_until)
        session.flush()
        return LoginResult(None, LoginRefused.WRONG_CREDENTIALS)
    if admin.disabled:
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
    expires_at = _aware(admin_session.expires_at)
    if admin_session.revoked_at is not None or expires_at is None or expires_at <= now:
        return None
    if admin.disabled:
        return None
    if admin.tenant_id is not None:
        tenant = session.get(Tenant, admin.tenant_id)
        if tenant is None or tenant.status == "deleted":
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


def _keep_one_admin(session: Session, leaving: Admin) -> None:
    others = session.scalar(
        select(func.count())
        .select_from(Admin)
        .where(Admin.role == "admin", Admin.disabled.is_(False), Admin.id != leaving.id)
    )
    if not others:
        raise Conflict("at least one enabled admin must remain")


def _aware(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything here is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)
