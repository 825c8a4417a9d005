"""Operator accounts for the admin console; passwords hashed with argon2 (pwdlib)."""

from __future__ import annotations

import re

from pwdlib import PasswordHash
from pwdlib.hashers.argon2 import Argon2Hasher
from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy.errors import Conflict, InvalidInput
from tenancy.models import Admin

_HASHER = PasswordHash((Argon2Hasher(),))
_USERNAME = re.compile(r"^[A-Za-z0-9_.@-]{1,100}$")
MIN_PASSWORD_LENGTH = 12
# Verifying against this keeps timing the same for unknown usernames.
_DUMMY_HASH = _HASHER.hash("prefixgate-timing-equaliser")


def create_admin(session: Session, username: str, password: str) -> Admin:
    if not _USERNAME.match(username):
        raise InvalidInput("username: 1-100 letters, digits or _ . @ -", "username")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise InvalidInput(
            f"password must be at least {MIN_PASSWORD_LENGTH} characters", "password"
        )
    if session.scalar(select(Admin.id).where(Admin.username == username)) is not None:
        raise Conflict(f"an admin named {username!r} already exists")
    admin = Admin(username=username, password_hash=_HASHER.hash(password))
    session.add(admin)
    session.flush()
    return admin


def verify_admin(session: Session, username: str, password: str) -> Admin | None:
    """The admin if the password is right and the account enabled, else None."""
    admin = session.scalar(select(Admin).where(Admin.username == username))
    if admin is None:
        _HASHER.verify(password, _DUMMY_HASH)
        return None
    if not _HASHER.verify(password, admin.password_hash) or admin.disabled:
        return None
    return admin
