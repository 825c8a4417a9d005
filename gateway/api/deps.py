"""Request dependencies as `Annotated` aliases: the gateway state and the authenticated caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gateway.auth import AuthenticationFailed, Principal
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy.audit_chain import AuditRecord


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


def client_ip(request: Request) -> str | None:
    return request.client.host if request.client else None


async def get_principal(
    request: Request,
    state: StateDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    """The tenant behind the bearer key; 401/403 otherwise, each failure audited."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", None, "shutting_down")
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        _audit_failure(state, request, "missing_key", None)
        raise APIError(401, "missing API key: send Authorization: Bearer <key>",
                       "authentication_error", None, "invalid_api_key")  # fmt: skip
    with state.tracer.start_as_current_span("auth"):
        try:
            principal = await state.auth.authenticate(presented.strip())
        except AuthenticationFailed as failure:
            _audit_failure(state, request, failure.failure.value, failure.key_id)
            raise
    state.tenant_names[principal.tenant_id] = principal.tenant_slug
    return principal


def _audit_failure(state: GatewayState, request: Request, reason: str, key_id: str | None) -> None:
    state.audit.put(
        AuditRecord(
            actor_type="api_key",
            actor_id=key_id,
            action="auth",
            outcome="failure",
            resource_type="endpoint",
            resource_id=request.url.path,
            source_ip=client_ip(request),
            details={"reason": reason},
        )
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]
UserHeaderDep = Annotated[str | None, Header(alias="X-PrefixGate-User", max_length=256)]
