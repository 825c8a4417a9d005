"""Operator accounts: the operators page (admins) and "My account" (every operator).

An admin creates operators (an `admin`, or a `tenant-admin` bound to one tenant, named by its
slug), disables and re-enables them and sets their passwords; every operator changes its own
password on its account page, giving its current one (the admin API's rule: a session left
open cannot take the account over; a wrong one counts against the caller's (name, address)
pair, like a failed login). All of it is the admin service's operator functions
(`gateway.admin.service.operators`): at least one enabled admin always remains, a disabled
account's sessions end at once, and no password reaches an answer, a page or the audit log.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import OperatorCreate, OperatorUpdate, PasswordChange
from gateway.admin.service import operators as operator_service
from gateway.console.pages import (
    CallerDep,
    ConsoleRoute,
    Form,
    FormDep,
    FormErrors,
    redirect,
    render,
)
from gateway.errors import APIError
from gateway.http.deps import StateDep
from gateway.state import GatewayState
from tenancy import tenants
from tenancy.errors import NotFound

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

CREATE_FIELDS = {"username", "password", "role", "tenant"}
ACCOUNT_FIELDS = {"current_password", "password", "password_again"}
MAX_SLUG = 63


@router.get("/operators")
def operators_page(request: Request, caller: CallerDep, state: StateDep) -> Response:
    """Every operator account, and the form that creates one."""
    return _operators_page(request, caller, state)


@router.post("/operators")
def create_operator(
    request: Request, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Create an operator; a tenant-admin names its tenant by slug."""
    try:
        body = _operator_body(form, state)
        operator_service.create_operator(state, caller, body)
    except APIError as error:
        if error.status not in (400, 404, 409):
            raise
        errors = FormErrors.of(error, {"tenant_id": "tenant"}, CREATE_FIELDS)
        status = 400 if error.status == 404 else error.status
        return _operators_page(request, caller, state, errors, form.values, status)
    return redirect("/admin/operators", done="operator_created")


@router.post("/operators/{operator_id}/disable")
def disable_operator(
    operator_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    operator_service.update_operator(state, caller, operator_id, OperatorUpdate(disabled=True))
    return redirect("/admin/operators", done="operator_disabled")


@router.post("/operators/{operator_id}/enable")
def enable_operator(
    operator_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    operator_service.update_operator(state, caller, operator_id, OperatorUpdate(disabled=False))
    return redirect("/admin/operators", done="operator_enabled")


@router.post("/operators/{operator_id}/password")
def set_password(
    request: Request, operator_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Set an operator's password (an admin: anyone else's; its own on "My account")."""
    if operator_id == caller.operator_id:
        # This form has no current password: the API would refuse and count a wrong guess.
        return redirect("/admin/account")
    try:
        operator_service.set_password(state, caller, operator_id, form.body(PasswordChange))
    except APIError as error:
        if error.status != 400:
            raise
        errors = FormErrors(form=f"Password not changed: {error.message}")
        return _operators_page(request, caller, state, errors, None, 400, operator_id)
    return redirect("/admin/operators", done="password_changed")


@router.get("/account")
def account_page(request: Request, caller: CallerDep) -> Response:
    """The operator's own account: who it is, and a form to change its password."""
    return render(request, "account.html", title="My account", errors=FormErrors())


@router.post("/account/password")
def change_own_password(
    request: Request, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Change this operator's own password; this session goes on, the others end."""
    if caller.operator_id is None:
        raise APIError.forbidden("only an operator account has a password")
    try:
        if form.get("password") != form.get("password_again"):
            raise APIError.invalid("the two passwords differ", "password_again")
        operator_service.set_password(state, caller, caller.operator_id, form.body(PasswordChange))
    except APIError as error:
        if error.status != 400:
            raise
        errors = FormErrors.of(error, {}, ACCOUNT_FIELDS)
        return render(request, "account.html", 400, title="My account", errors=errors)
    return redirect("/admin/account", done="password_changed")


def _operator_body(form: Form, state: GatewayState) -> OperatorCreate:
    """The API's body from the form: the tenant's slug becomes its id."""
    values = {name: form.get(name) for name in ("username", "password", "role")}
    slug = form.get("tenant").strip()
    if slug:
        if len(slug) > MAX_SLUG:
            raise APIError.invalid(f"tenant: at most {MAX_SLUG} characters", "tenant")
        with state.store.transaction() as session:
            try:
                values["tenant_id"] = str(tenants.get_tenant(session, slug).id)
            except NotFound as error:
                raise APIError.invalid(f"no tenant with slug {slug!r}", "tenant") from error
    return Form(values).body(OperatorCreate)


def _operators_page(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    errors: FormErrors | None = None,
    submitted: dict[str, str] | None = None,
    status: int = 200,
    failed_password: uuid.UUID | None = None,
) -> Response:
    operators = operator_service.list_operators(state, caller)
    with state.store.transaction() as session:
        slugs = {
            tenant.id: tenant.slug for tenant in tenants.list_tenants(session, include_deleted=True)
        }
    values = {"username": "", "role": "admin", "tenant": ""}
    if submitted is not None:
        values.update({k: v for k, v in submitted.items() if k in values})
    password_error = errors if failed_password is not None else None
    return render(
        request,
        "operators.html",
        status,
        title="Operators",
        operators=operators,
        slugs=slugs,
        values=values,
        errors=errors if failed_password is None and errors is not None else FormErrors(),
        password_error=password_error,
        failed_password=failed_password,
    )
