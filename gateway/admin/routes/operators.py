"""Operator accounts under /admin/api/operators: list, create, disable/enable, set a password,
and the caller's own TOTP second factor (under /me/totp).

Only an admin manages operators, except that any operator may change its own password
(gateway/admin/service/operators.py) and enrol or remove its own second factor
(gateway/admin/service/second_factor.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import (
    OperatorCreate,
    OperatorOut,
    OperatorUpdate,
    PasswordChange,
    TotpConfirm,
    TotpDisable,
    TotpEnrolmentOut,
)
from gateway.admin.service import operators, second_factor
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES, error_response

router = APIRouter(
    prefix="/admin/api/operators", tags=["admin: operators"], responses=ADMIN_RESPONSES
)

# Routes that check the caller's password count its failures as a login does.
_PASSWORD_CHECKED: dict[int | str, dict[str, Any]] = {
    429: error_response("Too many failed password checks for this name from this address"),
    503: error_response("Too many password checks at once; retry shortly"),
}


@router.get("")
def list_operators(caller: AdminDep, state: StateDep) -> list[OperatorOut]:
    """Every operator account, by username."""
    return operators.list_operators(state, caller)


@router.post("", status_code=201)
def create_operator(
    body: Annotated[OperatorCreate, Body()], caller: AdminDep, state: StateDep
) -> OperatorOut:
    """Create an operator: an `admin`, or a `tenant-admin` bound to `tenant_id`."""
    return operators.create_operator(state, caller, body)


@router.post("/me/totp")
def begin_totp_enrolment(caller: AdminDep, state: StateDep) -> TotpEnrolmentOut:
    """Begin enrolling a TOTP second factor for your own account: the secret, shown once,
    counts once a code from the app confirms it."""
    return second_factor.begin_enrolment(state, caller)


@router.post("/me/totp/confirm", status_code=204, responses=_PASSWORD_CHECKED)
def confirm_totp_enrolment(
    body: Annotated[TotpConfirm, Body()], caller: AdminDep, state: StateDep
) -> None:
    """Confirm the enrolment with the app's current code: logins then need a code too."""
    second_factor.confirm_enrolment(state, caller, body)


@router.post("/me/totp/disable", status_code=204, responses=_PASSWORD_CHECKED)
def disable_totp(body: Annotated[TotpDisable, Body()], caller: AdminDep, state: StateDep) -> None:
    """Remove your own second factor, giving your password and a current code."""
    second_factor.remove_own(state, caller, body)


@router.patch("/{operator_id}")
def update_operator(
    operator_id: uuid.UUID,
    body: Annotated[OperatorUpdate, Body()],
    caller: AdminDep,
    state: StateDep,
) -> OperatorOut:
    """Disable (its sessions end at once) or re-enable an operator."""
    return operators.update_operator(state, caller, operator_id, body)


@router.post("/{operator_id}/password", status_code=204, responses=_PASSWORD_CHECKED)
def set_password(
    operator_id: uuid.UUID,
    body: Annotated[PasswordChange, Body()],
    caller: AdminDep,
    state: StateDep,
) -> None:
    """Set an operator's password (an admin: anyone's; any operator: its own, giving the
    current one, so that an unattended session cannot take the account over)."""
    operators.set_password(state, caller, operator_id, body)
