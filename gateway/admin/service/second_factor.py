"""An operator's own TOTP second factor: begin enrolment, confirm it, remove it.

Only the operator itself enrols (with its session; an API key has no operator account):
beginning hands out a new secret once (an otpauth:// URI and the base32 text), which becomes
the account's second factor when the password and a code from the app confirm it. Removing it
takes the password *and* a current code. Both check the password under the login rules (per
(name, source) waits, audited): a session left open is not enough to add a second factor (and
lock the owner out with someone else's phone) or to strip one. The host CLI resets a
lost one (`prefixgate admins reset-totp NAME`). Every change is audited; no secret or code is
ever in an audit event.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from sqlalchemy.orm import Session

from gateway.admin.audited_change import Action, Changed, apply_change, refuse
from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import TotpConfirm, TotpDisable, TotpEnrolmentOut
from gateway.admin.service.credential_checks import (
    CheckRefused,
    guarded_check,
    wrong_credentials,
)
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import admins, totp


def begin_enrolment(state: GatewayState, caller: AdminCaller) -> TotpEnrolmentOut:
    """A new secret for the caller's own account, pending until `confirm_enrolment`."""
    operator_id = _own_account(caller)
    cipher = state.second_factor_rules.cipher

    def change(session: Session) -> Changed[TotpEnrolmentOut]:
        admin = admins.get_admin(session, operator_id)
        secret = totp.begin_enrolment(session, admin, cipher)
        uri = totp.provisioning_uri(secret, admin.username)
        return Changed(TotpEnrolmentOut(otpauth_uri=uri, secret=secret), None, None, None)

    action = Action("operator.totp_begin", "operator", str(operator_id))
    return apply_change(state, caller, action, change)


def confirm_enrolment(state: GatewayState, caller: AdminCaller, body: TotpConfirm) -> None:
    """Make the pending secret the account's second factor, given the account's password and
    a code that matches the secret."""
    operator_id = _own_account(caller)
    cipher = state.second_factor_rules.cipher
    action = Action("operator.totp_enable", "operator", str(operator_id))

    def check(session: Session) -> bool:
        return admins.password_matches(admins.get_admin(session, operator_id), body.password)

    _check_or_refuse(
        state, caller, action, check, wrong_credentials("the password is wrong", "password")
    )

    def change(session: Session) -> Changed[None]:
        admin = admins.get_admin(session, operator_id)
        totp.confirm_enrolment(session, admin, body.code, cipher)
        return Changed(None, None, {"second_factor": False}, {"second_factor": True})

    apply_change(state, caller, action, change)


def remove_own(state: GatewayState, caller: AdminCaller, body: TotpDisable) -> None:
    """Remove the caller's second factor, given its password and a current code."""
    operator_id = _own_account(caller)
    action = Action("operator.totp_disable", "operator", str(operator_id))
    rules = state.second_factor_rules

    def check(session: Session) -> bool:
        admin = admins.get_admin(session, operator_id)
        if not admins.password_matches(admin, body.password):
            totp.check_without_secret(body.code)  # and the code stays unused
            return False
        if admin.totp_secret is None:
            return True  # nothing to remove: the change below says so
        return totp.accept_code(session, admin, body.code, rules.cipher) is None

    wrong = wrong_credentials("the password or code is wrong", "code")
    _check_or_refuse(state, caller, action, check, wrong)

    def change(session: Session) -> Changed[None]:
        had = totp.remove(session, admins.get_admin(session, operator_id))
        if not had:
            raise APIError.conflict("this operator has no second factor")
        return Changed(None, None, {"second_factor": True}, {"second_factor": False})

    apply_change(state, caller, action, change)


def _check_or_refuse(
    state: GatewayState,
    caller: AdminCaller,
    action: Action,
    check: Callable[[Session], bool],
    wrong: APIError,
) -> None:
    """Run `check` under the login rules; refuse `action` (audited) when it must wait or
    comes out false."""
    try:
        right = guarded_check(state, caller.actor_id, caller.source_ip, check, lambda ok: not ok)
    except CheckRefused as refused:
        refuse(state, caller, action, refused.error)
    if not right:
        refuse(state, caller, action, wrong)


def _own_account(caller: AdminCaller) -> uuid.UUID:
    if caller.operator_id is None:
        raise APIError.forbidden("an API key has no operator account; log in as an operator")
    return caller.operator_id
