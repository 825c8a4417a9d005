"""POST /admin/api/login, POST /admin/api/logout, GET /admin/api/me.

Login is throttled per source and per (name, source), never locked, and audited; logout
revokes the session in every gateway at once (gateway/admin/service/sessions.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import CallerOut, LoginBody, LoginOut
from gateway.admin.service import sessions
from gateway.http.deps import StateDep
from gateway.http.middleware import client_ip
from gateway.http.openapi import ADMIN_RESPONSES, error_response

router = APIRouter(prefix="/admin/api", tags=["admin: sessions"], responses=ADMIN_RESPONSES)

_LOGIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: error_response(
        "Wrong username, password or one-time code (`invalid_credentials`, one answer for all)"
    ),
    403: error_response(
        "Right credentials, but the account is disabled, or an admin must enrol a second factor"
    ),
    429: error_response(
        "Too many attempts from this address, or too many failures of this name from it"
    ),
    503: error_response("Too many logins at once; retry shortly"),
}


@router.post("/login", responses=_LOGIN_RESPONSES)
def login(body: Annotated[LoginBody, Body()], request: Request, state: StateDep) -> LoginOut:
    """Trade an operator's username and password for a short-lived session token."""
    source_ip = client_ip(request.scope)
    return sessions.create_session(state, body.username, body.password, source_ip, body.totp_code)


@router.post("/logout", status_code=204)
def logout(caller: AdminDep, state: StateDep) -> None:
    """End this session: its token stops working at once."""
    sessions.end_session(state, caller)


@router.get("/me")
def me(caller: AdminDep) -> CallerOut:
    """Who this token or key speaks for: role and, for a tenant-admin, its tenant."""
    return sessions.describe_caller(caller)
