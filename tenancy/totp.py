"""The optional TOTP second factor of operator accounts (RFC 6238 via pyotp): enrolment,
code checks that accept each code once, and its secrets encrypted at rest.

Enrolment has two steps: `begin_enrolment` keeps a new secret as *pending* and hands it out
(as an otpauth:// URI for an authenticator app), `confirm_enrolment` makes it the account's
second factor once a code from the app matches, so a secret nobody could read never locks
anybody out. A code is accepted within one 30-second step either side of now, and only for a
step later than the last one accepted: a code seen once (over a shoulder, in a log) is
refused afterwards, across every gateway (one conditional UPDATE decides).

Secrets are stored as Fernet tokens under a key derived (HKDF-SHA256) from a deployment
secret the database never holds, so a dump of the database alone gives no second factor.
"""

from __future__ import annotations

import base64
import enum
import hmac
import logging
from dataclasses import dataclass
from datetime import datetime

import pyotp
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from tenancy.errors import Conflict, InvalidInput
from tenancy.models import Admin, utcnow

logger = logging.getLogger(__name__)

ISSUER = "PrefixGate"
STEP_S = 30
# Steps either side of now a code may come from: clocks and typing take time.
WINDOW_STEPS = 1
_KEY_CONTEXT = b"prefixgate operator totp secrets v1"
# Checked against when there is no real secret, so that the work is the same either way.
_DUMMY_SECRET = pyotp.random_base32()


class CodeRefused(enum.Enum):
    WRONG = "wrong_totp_code"
    REUSED = "reused_totp_code"


class UnreadableSecret(Exception):
    """A stored TOTP secret does not decrypt under this deployment's key."""


@dataclass(frozen=True, slots=True)
class TotpCipher:
    """Encrypts and decrypts operators' TOTP secrets under one deployment key."""

    fernet: Fernet

    @classmethod
    def from_secret(cls, deployment_secret: str) -> TotpCipher:
        """The cipher keyed by HKDF-SHA256 of a deployment secret (a context of its own)."""
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KEY_CONTEXT).derive(
            deployment_secret.encode()
        )
        return cls(Fernet(base64.urlsafe_b64encode(key)))

    def encrypt(self, secret: str) -> str:
        return self.fernet.encrypt(secret.encode()).decode()

    def decrypt(self, stored: str) -> str:
        try:
            return self.fernet.decrypt(stored.encode()).decode()
        except InvalidToken as error:
            raise UnreadableSecret("the stored TOTP secret does not decrypt") from error


def provisioning_uri(secret: str, username: str) -> str:
    """The otpauth:// URI an authenticator app reads (as a QR code or pasted)."""
    return pyotp.TOTP(secret).provisioning_uri(name=username, issuer_name=ISSUER)


def matching_step(secret: str, code: str, now: datetime | None = None) -> int | None:
    """The time step within the window whose code is `code`, else None (constant-time
    compare against every step of the window, whichever matches)."""
    now = now or utcnow()
    totp = pyotp.TOTP(secret, interval=STEP_S)
    current = int(now.timestamp()) // STEP_S
    found = None
    for step in range(current - WINDOW_STEPS, current + WINDOW_STEPS + 1):
        if hmac.compare_digest(totp.generate_otp(step).encode(), code.strip().encode()):
            found = step
    return found


def check_without_secret(code: str | None) -> None:
    """Do a code check's work against no account: unknown names cost what known ones do."""
    matching_step(_DUMMY_SECRET, code or "")


def accept_code(
    session: Session, admin: Admin, code: str, cipher: TotpCipher, now: datetime | None = None
) -> CodeRefused | None:
    """None if `code` is the account's current code, used here for the first time (its step
    is then marked used, for every gateway at once); else why it is refused."""
    if admin.totp_secret is None:
        return CodeRefused.WRONG
    try:
        secret = cipher.decrypt(admin.totp_secret)
    except UnreadableSecret:  # kept under another key-hashing secret: no code can match
        logger.error(
            "operator %s: its TOTP secret does not decrypt under this deployment's key-hashing "
            "secret; run `prefixgate admins reset-totp %s` and enrol again",
            admin.username,
            admin.username,
        )
        check_without_secret(code)
        return CodeRefused.WRONG
    step = matching_step(secret, code, now)
    if step is None:
        return CodeRefused.WRONG
    # Only a step later than the last accepted one: two logins with one code, even at the
    # same moment on two gateways, see one of them win.
    taken = session.execute(
        update(Admin)
        .where(
            Admin.id == admin.id,
            or_(Admin.totp_last_step.is_(None), Admin.totp_last_step < step),
        )
        .values(totp_last_step=step)
        .execution_options(synchronize_session=False)
    )
    return None if taken.rowcount else CodeRefused.REUSED  # type: ignore[attr-defined]


def begin_enrolment(session: Session, admin: Admin, cipher: TotpCipher) -> str:
    """A new secret for the account, pending until a code confirms it; Conflict if the
    account already has a second factor (disable it first)."""
    if admin.totp_secret is not None:
        raise Conflict("this operator already has a second factor; disable it first")
    secret = pyotp.random_base32()
    admin.totp_pending_secret = cipher.encrypt(secret)
    session.flush()
    return secret


def confirm_enrolment(
    session: Session, admin: Admin, code: str, cipher: TotpCipher, now: datetime | None = None
) -> None:
    """Make the pending secret the account's second factor if `code` is its current code."""
    if admin.totp_secret is not None:
        raise Conflict("this operator already has a second factor; disable it first")
    if admin.totp_pending_secret is None:
        raise Conflict("no enrolment is under way: begin one first")
    now = now or utcnow()
    step = matching_step(cipher.decrypt(admin.totp_pending_secret), code, now)
    if step is None:
        raise InvalidInput("the code does not match: check the app's clock and try again", "code")
    admin.totp_secret = admin.totp_pending_secret
    admin.totp_pending_secret = None
    admin.totp_last_step = step  # the confirming code is used
    admin.totp_enabled_at = now
    session.flush()


def remove(session: Session, admin: Admin) -> bool:
    """Remove the account's second factor (and any enrolment under way); whether it had one."""
    had = admin.totp_secret is not None
    admin.totp_secret = None
    admin.totp_pending_secret = None
    admin.totp_last_step = None
    admin.totp_enabled_at = None
    session.flush()
    return had
