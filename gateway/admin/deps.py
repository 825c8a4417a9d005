"""The admin API's caller as a request dependency: `AdminDep`.

Admin routes resolve their caller from the `Authorization: Bearer ...` header: an operator's
session token or a tenant-admin API key (gateway/admin/callers.py checks either, and audits a
refusal). The bearer scheme is declared here so that the API's schema offers it on every admin
route; the header itself is read whole, so a missing or malformed one is the API's own 401,
and one sent twice is a 400 (`single_header`), never first-wins.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.admin.callers import AdminCaller, authenticate_admin
from gateway.http.deps import single_header
from gateway.http.middleware import client_ip
from gateway.state import GatewayState

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
    authorization = single_header(request.headers, "Authorization")
    return authenticate_admin(state, authorization, client_ip(request.scope))


AdminDep = Annotated[AdminCaller, Depends(get_admin_caller)]
