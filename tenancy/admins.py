"""Operator accounts for the admin console: passwords (argon2, pwdlib), roles, logins with
an optional TOTP second factor (tenancy/totp.py).

An `admin` runs every tenant; a `tenant-admin` is bound to one tenant. At least one enabled
`admin` always remains. `login` says why a login is refused, for the audit log; the caller
answers every refusal that could confirm a name or a password the same way. An unknown name
costs the same argon2 and TOTP work as a known one. No account ever locks: failed logins slow
down their own (name, source) pair only (tenancy/login_failures.py). The second factor is
checked after the password and before the account's state, so that only whoever holds both
learns that an account is disabled.
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

from tenancy import totp
from tenancy.errors import Conflict, InvalidInput, NotFound
from tenancy.models import OPERATOR_ROLES, Admin, AdminSession, Tenant, utcnow
from tenancy.totp import TotpCipher

_HASHER = PasswordHash((Argon2Hasher(),))
_USERNAME = re.compile(r"^[A-Za-z0-9_.@-]{1,100}$")
MIN_PASSWORD_LENGTH = 12
MAX_PASSWORD_LENGTH = 1024  # argon2 takes any length; a megabyte password is only a cost
# Verifying against this keeps timing the same for unknown usernames.
_DUMMY_HASH = _HASHER.hash("prefixgate-timing-equaliser")


class LoginRefused(enum.Enum):
    """Why a login was refused (the audit event's reason)."""

    UNKNOWN_OPERATOR = "unknown_operator"
    WRONG_PASSWORD = "wrong_password"
    MISSING_CODE = "missing_totp_code"
    WRONG_CODE = "wrong_totp_code"
    REUSED_CODE = "reused_totp_code"
    # Only once the password (and code, if enrolled) was right:
    DISABLED = "disabled"
    SECOND_FACTOR_NOT_ENROLLED = "second_factor_not_enrolled"

    @property
    def is_failed_guess(self) -> bool:
        """A wrong name, password or code: counted against its (name, source) pair, and
        answered exactly like every other failed guess."""
        return self not in (LoginRefused.DISABLED, LoginRefused.SECOND_FACTOR_NOT_ENROLLED)


@dataclass(frozen=True, slots=True)
class SecondFactorRules:
    """How logins treat the TOTP second factor: the cipher of stored secrets, and whether an
    `admin` must have one enrolled to log in."""

    cipher: TotpCipher
    required_for_admins: bool = False


@dataclass(frozen=True, slots=True)
class LoginResult:
    admin: Admin | None
    refused: LoginRefused | None = None


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
    """Disable (every session of it revoked at once) or re-enable an operator."""
    admin = get_admin(session, admin_id)
    if disabled and admin.role == "admin" and not admin.disabled:
        _disable_unless_last_admin(session, admin)
    admin.disabled = disabled
    if disabled:
        revoke_sessions(session, admin.id)
    session.flush()
    return admin


def change_password(
    session: Session, admin_id: uuid.UUID, password: str, keep_session: str | None = None
) -> Admin:
    """Set a new password and end every other session of the account."""
    check_password(password)
    admin = get_admin(session, admin_id)
    admin.password_hash = _HASHER.hash(_normalized(password))
    admin.password_changed_at = utcnow()
    revoke_sessions(session, admin.id, keep=keep_session)
    session.flush()
    return admin


def login(
    session: Session,
    username: str,
    password: str,
    code: str | None,
    rules: SecondFactorRules,
    now: datetime | None = None,
) -> LoginResult:
    """Check a username, password and (for an account that has one) TOTP code; the result
    says the operator, or why not."""
    admin = session.scalar(select(Admin).where(Admin.username == username))
    if admin is None:
        password_matches(None, password)
        totp.check_without_secret(code)
        return LoginResult(None, LoginRefused.UNKNOWN_OPERATOR)
    if not password_matches(admin, password):
        totp.check_without_secret(code)
        return LoginResult(None, LoginRefused.WRONG_PASSWORD)
    refused = _second_factor(session, admin, code, rules, now)
    if refused is None and (admin.disabled or not _tenant_active(session, admin)):
        refused = LoginRefused.DISABLED
    return LoginResult(None, refused) if refused is not None else LoginResult(admin)


def password_matches(admin: Admin | None, password: str) -> bool:
    """Whether `password` is the operator's; with no operator, the same argon2 work (False)."""
    password = _normalized(password[:MAX_PASSWORD_LENGTH])
    if admin is None:
        _HASHER.verify(password, _DUMMY_HASH)
        return False
    return _HASHER.verify(password, admin.password_hash)


def _second_factor(
    session: Session,
    admin: Admin,
    code: str | None,
    rules: SecondFactorRules,
    now: datetime | None,
) -> LoginRefused | None:
    """Why the account's second factor refuses this login, or None."""
    if admin.totp_secret is None:
        totp.check_without_secret(code)
        if rules.required_for_admins and admin.role == "admin":
            return LoginRefused.SECOND_FACTOR_NOT_ENROLLED
        return None
    if not code:
        totp.check_without_secret(code)
        return LoginRefused.MISSING_CODE
    refused = totp.accept_code(session, admin, code, rules.cipher, now)
    if refused is totp.CodeRefused.REUSED:
        return LoginRefused.REUSED_CODE
    return None if refused is None else LoginRefused.WRONG_CODE


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
