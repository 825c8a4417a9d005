"""Who is calling the admin API or console, and which tenants they may see.

Two kinds of credential administer PrefixGate: an operator's session token (a JWT from
`POST /admin/api/login`, or the console's cookie holding one) and a tenant's `tenant-admin`
API key. An `admin` operator sees every tenant; a `tenant-admin` (key or operator) sees only
its own, and any other tenant is simply not found: the answer is the same 404 as for a tenant
that does not exist, so ids cannot be probed. Role and tenant are read from the database on
every call, never trusted from the token, so a disabled operator stops at once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session

from gateway.auth.admin_tokens import InvalidToken
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import admins, api_keys, key_format, tenants
from tenancy.api_keys import VerifiedKey
from tenancy.audit_chain import AuditRecord
from tenancy.models import Tenant

ADMIN_ONLY = "this needs an admin; a tenant-admin manages its own tenant"


@dataclass(frozen=True, slots=True)
class AdminCaller:
    """An authenticated administrator: an operator (by session) or a tenant-admin key."""

    role: str  # "admin" or "tenant-admin"
    tenant_id: uuid.UUID | None  # the one tenant a tenant-admin administers
    actor_type: str  # "operator" or "api_key", as the audit log names actors
    actor_id: str  # the operator's username or the key's public id
    operator_id: uuid.UUID | None = None
    session_id: str | None = None  # the token's jti (operators only)
    source_ip: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def sees(self, tenant_id: uuid.UUID | str | None) -> bool:
        """Whether this caller may see the tenant (an admin sees all, and global events)."""
        return self.is_admin or (tenant_id is not None and str(tenant_id) == str(self.tenant_id))

    def require_admin(self) -> None:
        """Refuse a tenant-admin a call that spans tenants (403)."""
        if not self.is_admin:
            raise APIError.forbidden(ADMIN_ONLY)


def visible_tenant(session: Session, caller: AdminCaller, tenant_id: uuid.UUID) -> Tenant:
    """The tenant, if it exists, is not deleted and the caller may see it; else a 404."""
    tenant = session.get(Tenant, tenant_id) if caller.sees(tenant_id) else None
    if tenant is None or tenant.status == "deleted":
        raise APIError.not_found(f"no tenant with id {tenant_id}")
    return tenant


def visible_tenants(
    session: Session, caller: AdminCaller, text: str = "", limit: int = 50, offset: int = 0
) -> tuple[list[Tenant], int]:
    """One page of the live tenants the caller may see whose slug or name contains `text`,
    and how many match in all (a tenant-admin: its own tenant or nothing)."""
    if caller.is_admin:
        return tenants.search_tenants(session, text, limit, offset)
    assert caller.tenant_id is not None  # a tenant-admin always has its tenant
    own = visible_tenant(session, caller, caller.tenant_id)
    needle = text.lower()
    matches = needle in own.slug or needle in own.display_name.lower()
    return ([own] if matches and offset == 0 else []), int(matches)


def authenticate_admin(
    state: GatewayState, authorization: str | None, source_ip: str | None
) -> AdminCaller:
    """The caller behind an `Authorization: Bearer ...` header (blocking: database reads).

    Raises a 401 for a missing, malformed, expired, wrongly signed or revoked credential (and
    audits the failure), a 403 for an API key that is not a tenant-admin key.
    """
    scheme, _, credential = (authorization or "").partition(" ")
    credential = credential.strip()
    if scheme.lower() != "bearer" or not credential:
        raise APIError.admin_unauthorized("this needs an admin token: Authorization: Bearer ...")
    if credential.startswith(f"{key_format.PREFIX}_"):
        return _key_caller(state, credential, source_ip)
    return caller_from_token(state, credential, source_ip)


def caller_from_token(state: GatewayState, token: str, source_ip: str | None) -> AdminCaller:
    """The operator behind a session token whose session is still open (blocking)."""
    try:
        claims = state.admin_tokens.check(token)
    except InvalidToken as error:
        _audit_refusal(state, "invalid_token", None, source_ip)
        raise APIError.admin_unauthorized(str(error)) from error
    with state.store.transaction() as session:
        operator = admins.active_session(session, claims.jti)
        if operator is None or str(operator.id) != claims.subject:
            _audit_refusal(state, "session_ended", claims.subject, source_ip)
            raise APIError.admin_unauthorized("this admin session has ended; log in again")
        return AdminCaller(
            role=operator.role,
            tenant_id=operator.tenant_id,
            actor_type="operator",
            actor_id=operator.username,
            operator_id=operator.id,
            session_id=claims.jti,
            source_ip=source_ip,
        )


def _key_caller(state: GatewayState, presented: str, source_ip: str | None) -> AdminCaller:
    with state.store.transaction() as session:
        result = api_keys.authenticate(session, presented, state.store.key_secret)
    if not isinstance(result, VerifiedKey):
        _audit_refusal(state, result.value, None, source_ip)
        raise APIError.admin_unauthorized("invalid API key")
    if result.role != "tenant-admin":
        _audit_refusal(state, "not_tenant_admin", result.key_id, source_ip)
        raise APIError.forbidden(
            "this API key is for inference; administering needs a tenant-admin key"
        )
    return AdminCaller(
        role="tenant-admin",
        tenant_id=result.tenant_id,
        actor_type="api_key",
        actor_id=result.key_id,
        source_ip=source_ip,
    )


def _audit_refusal(
    state: GatewayState, reason: str, actor_id: str | None, source_ip: str | None
) -> None:
    state.audit.put(
        AuditRecord(
            actor_type="admin",
            actor_id=actor_id,
            action="admin.auth",
            outcome="failure",
            source_ip=source_ip,
            details={"reason": reason},
        )
    )
