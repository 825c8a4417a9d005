"""Logging in and out of the console, and its front door.

Login posts the username, password and (for an operator with a second factor) one-time code
to the admin service's `create_session` (throttled per address and per (name, address), never
locked, audited), as the admin API's login does, and the session token it returns goes into
the HttpOnly cookie. A refusal (wrong credentials, a disabled account, too many attempts)
shows the login form again with the reason. Logout is the admin
service's `end_session`: the session is revoked in the database, so the cookie is worthless
even if it was copied.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from gateway.admin.schemas import LoginBody
from gateway.admin.service import sessions
from gateway.console import session
from gateway.console.pages import (
    CSRF_FIELD,
    CallerDep,
    ConsoleRoute,
    CsrfRefused,
    Form,
    FormDep,
    FormErrors,
    Notice,
    read_form,
    redirect,
    render,
)
from gateway.errors import APIError
from gateway.http.deps import StateDep
from gateway.http.middleware import client_ip

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

# Why the login page is shown: information, not a success (and not an error either).
REASONS = {
    "login": Notice("Log in to continue.", "info"),
    "expired": Notice(
        "Your session has ended (it expired, was revoked, or the account was disabled). "
        "Log in again.",
        "warning",
    ),
}


@router.get("")
def home(caller: CallerDep) -> Response:
    """An admin starts at the tenants table, a tenant-admin at its own tenant."""
    if caller.tenant_id is not None and not caller.is_admin:
        return redirect(f"/admin/tenants/{caller.tenant_id}")
    return redirect("/admin/tenants")


@router.get("/login")
def login_page(request: Request, state: StateDep, reason: str = "") -> Response:
    """The login form, with a fresh CSRF nonce unless the browser already holds one."""
    return _login_form(request, state, REASONS.get(reason), FormErrors(), "")


@router.post("/login")
def login(
    request: Request, state: StateDep, values: Annotated[dict[str, str], Depends(read_form)]
) -> Response:
    """Check the login form's CSRF token, then the credentials; open a session."""
    secret = state.settings.secret("jwt_secret")
    nonce = request.cookies.get(session.LOGIN_COOKIE, "")
    if not nonce or not session.token_matches(
        session.login_csrf(secret, nonce), values.get(CSRF_FIELD)
    ):
        raise CsrfRefused
    form = Form(values)
    username = form.get("username").strip()
    try:
        body = form.body(LoginBody)
        source_ip = client_ip(request.scope)
        answer = sessions.create_session(
            state, body.username, body.password, source_ip, body.totp_code
        )
    except APIError as error:
        errors = FormErrors.of(error, {}, {"username", "password", "totp_code"})
        status = error.status if error.status in (401, 403, 429) else 400
        response = _login_form(request, state, None, errors, username, status)
        response.headers.update(error.headers)
        return response
    response = redirect("/admin")
    session.set_session_cookie(request, response, answer.token, answer.expires_at)
    session.clear_login_cookie(request, response)
    return response


@router.post("/logout")
def logout(request: Request, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """End the session (revoked for every gateway) and forget the cookie."""
    sessions.end_session(state, caller)
    response = redirect("/admin/login", done="logged_out")
    session.clear_session_cookie(request, response)
    return response


def _login_form(
    request: Request,
    state: StateDep,
    message: Notice | None,
    errors: FormErrors,
    username: str,
    status: int = 200,
) -> Response:
    nonce = request.cookies.get(session.LOGIN_COOKIE, "")
    if not (16 <= len(nonce) <= 64 and nonce.replace("-", "").replace("_", "").isalnum()):
        nonce = session.new_login_nonce()
    csrf = session.login_csrf(state.settings.secret("jwt_secret"), nonce)
    response = render(
        request,
        "login.html",
        status,
        title="Log in",
        message=message,
        errors=errors,
        username=username,
        login_csrf=csrf,
    )
    session.set_login_cookie(request, response, nonce)
    return response
