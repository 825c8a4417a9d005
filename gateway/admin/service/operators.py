"""Operator accounts: list, create, disable/enable, set a password.

Only an admin manages operators (a tenant-admin gets 403), with one exception: any operator
may change its own password, giving its current one. Disabling an account ends its sessions at
once; the last enabled admin cannot be disabled (409), so somebody can always log in. A
password change ends every other session of the account (the caller's own session goes on when
it changed its own). Passwords go into argon2 hashes and nowhere else: not into answers, audit
events or logs.
"""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from gateway.admin.audited_change import Action, Changed, apply_change, refuse
from gateway.admin.callers import AdminCaller
from gateway.admin.outputs import operator_out
from gateway.admin.schemas import OperatorCreate, OperatorOut, OperatorUpdate, PasswordChange
from gateway.admin.service.credential_checks import (
    CheckRefused,
    guarded_check,
    wrong_credentials,
)
from gateway.state import GatewayState
from tenancy import admins
from tenancy.models import Admin


def list_operators(state: GatewayState, caller: AdminCaller) -> list[OperatorOut]:
    """Every operator account, by username (admins only)."""
    caller.require_admin()
    with state.store.transaction() as session:
        return [operator_out(admin) for admin in admins.list_admins(session)]


def create_operator(state: GatewayState, caller: AdminCaller, body: OperatorCreate) -> OperatorOut:
    """Create an operator: an `admin`, or a `tenant-admin` bound to `tenant_id`."""

    def change(session: Session) -> Changed[OperatorOut]:
        admin = admins.create_admin(
            session, body.username, body.password, body.role, body.tenant_id
        )
        return Changed(operator_out(admin), _tenant(admin), None, _audit_view(admin))

    tenant_id = None if body.tenant_id is None else str(body.tenant_id)
    action = Action("operator.create", "operator", body.username, tenant_id, admin_only=True)
    return apply_change(state, caller, action, change)


def update_operator(
    state: GatewayState, caller: AdminCaller, operator_id: uuid.UUID, body: OperatorUpdate
) -> OperatorOut:
    """Disable (its sessions end at once) or re-enable an operator."""

    def change(session: Session) -> Changed[OperatorOut]:
        before = _audit_view(admins.get_admin(session, operator_id))
        admin = admins.set_disabled(session, operator_id, body.disabled)
        return Changed(operator_out(admin), _tenant(admin), before, _audit_view(admin))

    name = "operator.disable" if body.disabled else "operator.enable"
    action = Action(name, "operator", str(operator_id), admin_only=True)
    return apply_change(state, caller, action, change)


def set_password(
    state: GatewayState, caller: AdminCaller, operator_id: uuid.UUID, body: PasswordChange
) -> None:
    """Set an operator's password (an admin: anyone's; any operator: its own, giving the
    current one, so that an unattended session cannot take the account over)."""
    own = caller.operator_id == operator_id
    if own:
        _check_current_password(state, caller, body.current_password or "")

    def change(session: Session) -> Changed[None]:
        admin = admins.change_password(
            session, operator_id, body.password, keep_session=caller.session_id if own else None
        )
        # The audit event says that it changed and when, never what it is.
        changed_at = admin.password_changed_at
        view = {**_audit_view(admin), "password_changed_at": changed_at and changed_at.isoformat()}
        return Changed(None, _tenant(admin), None, view)

    action = Action("operator.set_password", "operator", str(operator_id), admin_only=not own)
    apply_change(state, caller, action, change)


def _check_current_password(state: GatewayState, caller: AdminCaller, password: str) -> None:
    """Refuse (audited) a wrong current password; a wrong guess counts against the caller's
    (name, source) pair like a failed login, in a transaction of its own so that the refusal
    does not roll the count back."""
    operator_id = caller.operator_id
    action = Action("operator.set_password", "operator", str(operator_id))

    def check(session: Session) -> bool:
        return admins.password_matches(session.get(Admin, operator_id), password)

    try:
        right = guarded_check(state, caller.actor_id, caller.source_ip, check, lambda ok: not ok)
    except CheckRefused as refused:
        refuse(state, caller, action, refused.error)
    if not right:
        refuse(
            state,
            caller,
            action,
            wrong_credentials("the current password is wrong", "current_password"),
        )


def _tenant(admin: Admin) -> str | None:
    return None if admin.tenant_id is None else str(admin.tenant_id)


def _audit_view(admin: Admin) -> dict[str, object]:
    """The account as its audit events record it (no password, no hash)."""
    return {
        "username": admin.username,
        "role": admin.role,
        "tenant_id": _tenant(admin),
        "disabled": admin.disabled,
    }
