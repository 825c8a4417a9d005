"""Operator sessions: log in, log out, and who a credential speaks for.

A login is checked under the login rules (gateway/admin/service/credential_checks.py: per
source, then per (name, source) pair with a growing wait; never a lock on the account) and
every attempt is audited whatever its outcome, with the reason. An unknown name, a wrong
password and a wrong or missing one-time code all get the same 401 `invalid_credentials`, after
the same work. Only whoever gives the right password (and code, where one is enrolled) learns
more: that the account is disabled (403), or that it must enrol a second factor first (403,
where `admin_totp_required`). Logout revokes the session at once, in every gateway (they read
it per call).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from gateway.admin.callers import AdminCaller
from gateway.admin.outputs import operator_out
from gateway.admin.schemas import CallerOut, LoginOut
from gateway.admin.service.credential_checks import CheckRefused, guarded_check
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import admins
from tenancy.admins import LoginRefused, LoginResult
from tenancy.audit_chain import AuditRecord


def create_session(
    state: GatewayState,
    username: str,
    password: str,
    source_ip: str | None,
    totp_code: str | None = None,
) -> LoginOut:
    """Check the credentials (throttled, audited) and open a session with a fresh token."""

    def audit(outcome: str, reason: str | None = None) -> None:
        state.store.record(
            AuditRecord(
                actor_type="operator",
                actor_id=username,
                action="admin.login",
                outcome=outcome,
                source_ip=source_ip,
                details={} if reason is None else {"reason": reason},
            )
        )

    def check(session: Session) -> tuple[LoginResult, LoginOut | None]:
        result = admins.login(session, username, password, totp_code, state.second_factor_rules)
        if result.admin is None:
            return result, None
        issued = state.admin_tokens.issue(str(result.admin.id))
        admins.open_session(session, result.admin, issued.jti, issued.expires_at)
        answer = LoginOut(
            token=issued.token, expires_at=issued.expires_at, operator=operator_out(result.admin)
        )
        return result, answer

    def failed_guess(outcome: tuple[LoginResult, LoginOut | None]) -> bool:
        refused = outcome[0].refused
        return refused is not None and refused.is_failed_guess

    try:
        result, answer = guarded_check(state, username, source_ip, check, failed_guess)
    except CheckRefused as refused:
        audit("failure", refused.reason)
        raise refused.error from None
    if answer is not None:
        audit("success")
        return answer
    assert result.refused is not None
    audit("failure", result.refused.value)
    if result.refused is LoginRefused.DISABLED:
        raise APIError.forbidden("this operator account is disabled")
    if result.refused is LoginRefused.SECOND_FACTOR_NOT_ENROLLED:
        raise APIError.second_factor_required(username)
    raise APIError.login_failed()


def end_session(state: GatewayState, caller: AdminCaller) -> None:
    """End the caller's session (audited): its token stops working at once."""
    if caller.session_id is None:
        raise APIError.invalid("an API key has no session to end; revoke the key instead")
    with state.store.transaction() as session:
        admins.revoke_session(session, caller.session_id)
    state.store.record(
        AuditRecord(
            actor_type=caller.actor_type,
            actor_id=caller.actor_id,
            action="admin.logout",
            outcome="success",
            source_ip=caller.source_ip,
        )
    )


def describe_caller(caller: AdminCaller) -> CallerOut:
    """Who a token or key speaks for: role and, for a tenant-admin, its tenant."""
    return CallerOut(
        role=caller.role,
        tenant_id=caller.tenant_id,
        actor_type=caller.actor_type,
        actor_id=caller.actor_id,
    )
