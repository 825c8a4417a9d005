"""Operator accounts under /admin/api/operators: list, create, disable/enable, set a password.

Only an admin manages operators, except that any operator may change its own password
(gateway/admin/service/operators.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import OperatorCreate, OperatorOut, OperatorUpdate, PasswordChange
from gateway.admin.service import operators
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

router = APIRouter(
    prefix="/admin/api/operators", tags=["admin: operators"], responses=ADMIN_RESPONSES
)


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


@router.patch("/{operator_id}")
def update_operator(
    operator_id: uuid.UUID,
    body: Annotated[OperatorUpdate, Body()],
    caller: AdminDep,
    state: StateDep,
) -> OperatorOut:
    """Disable (its sessions end at once) or re-enable an operator."""
    return operators.update_operator(state, caller, operator_id, body)


@router.post("/{operator_id}/password", status_code=204)
def set_password(
    operator_id: uuid.UUID,
    body: Annotated[PasswordChange, Body()],
    caller: AdminDep,
    state: StateDep,
) -> None:
    """Set an operator's password (an admin: anyone's; any operator: its own, giving the
    current one, so that an unattended session cannot take the account over)."""
    operators.set_password(state, caller, operator_id, body)
