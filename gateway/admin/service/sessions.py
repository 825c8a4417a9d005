"""Operator sessions: log in, log out, and who a credential speaks for.

Login is throttled per username and per client address (429 with Retry-After) before any
password is hashed, and every attempt is audited whatever its outcome. A locked account says
until when. Logout revokes the session at once, in every gateway (they read it per call).
"""

from __future__ import annotations

from gateway.admin.callers import AdminCaller
from gateway.admin.outputs import operator_out
from gateway.admin.schemas import CallerOut, LoginOut
from gateway.auth.login_throttle import PasswordChecksBusy
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import admins
from tenancy.admins import LoginRefused
from tenancy.audit_chain import AuditRecord


def create_session(
    state: GatewayState, username: str, password: str, source_ip: str | None
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

    wait = state.login_throttle.admit(username, source_ip)
    if wait is not None:
        audit("failure", "throttled")
        raise APIError.rate_limited(
            "too many login attempts; try again later", wait, code="too_many_login_attempts"
        )
    lockout = state.settings.admin_lockout()
    try:
        with state.login_throttle.password_check(), state.store.transaction() as session:
            result = admins.login(session, username, password, lockout)
            if result.admin is not None:
                issued = state.admin_tokens.issue(str(result.admin.id))
                admins.open_session(session, result.admin, issued.jti, issued.expires_at)
                answer = LoginOut(
                    token=issued.token,
                    expires_at=issued.expires_at,
                    operator=operator_out(result.admin),
                )
    except PasswordChecksBusy as busy:
        audit("failure", "busy")
        raise APIError.overloaded("too many logins at once; retry shortly", 2) from busy
    if result.refused is LoginRefused.LOCKED:
        assert result.locked_until is not None
        audit("failure", "locked")
        raise APIError.account_locked(result.locked_until.isoformat(timespec="seconds"))
    if result.refused is LoginRefused.DISABLED:
        audit("failure", "disabled")
        raise APIError.forbidden("this operator account is disabled")
    if result.refused is not None:
        audit("failure", result.refused.value)
        raise APIError.admin_unauthorized("wrong username or password")
    audit("success")
    return answer


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
