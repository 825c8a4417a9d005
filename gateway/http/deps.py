"""Request dependencies as `Annotated` aliases: the gateway state, the request's settlement,
and the admin caller.

For /v1 the request gate (gateway/http/middleware.py) has already checked the API key from the
headers before any route runs; routes read the caller from the settlement it opened. Admin
routes resolve their caller here, from a bearer session token or a tenant-admin key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.admin.callers import AdminCaller, authenticate_admin
from gateway.http.middleware import client_ip
from gateway.http.settlement import Settlement
from gateway.state import GatewayState


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def get_settlement(request: Request) -> Settlement:
    settlement: Settlement = request.state.settlement
    return settlement


_admin_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="AdminToken",
    description="A session token from POST /admin/api/login, or a tenant-admin API key",
)


def get_admin_caller(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_bearer)],
) -> AdminCaller:
    """The admin caller (sync: FastAPI runs it in a worker thread, it reads the database)."""
    state: GatewayState = request.app.state.gateway
    authorization = request.headers.get("authorization")
    return authenticate_admin(state, authorization, client_ip(request.scope))


StateDep = Annotated[GatewayState, Depends(get_state)]
SettlementDep = Annotated[Settlement, Depends(get_settlement)]
UserHeaderDep = Annotated[
    str | None, Header(alias="X-PrefixGate-User", max_length=256, pattern=r"^[^\x00-\x1f]*$")
]
AdminDep = Annotated[AdminCaller, Depends(get_admin_caller)]
