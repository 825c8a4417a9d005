"""A tenant's API keys on its page: create, revoke, rotate.

These are the admin service's key functions (`gateway.admin.service.keys`), so a
tenant-admin manages its own tenant's keys here as it can through the API, and nobody else's.
A new key's secret (from a creation or a rotation) is rendered into the answer to that POST,
once: it is not stored, the page is never cached (`Cache-Control: no-store`), and reloading
the tenant's page shows only the key's public id. The create and rotate forms are single-use
(`form_nonces`): posting one again (a reload, a history entry, a double click) makes no second
key, and the answer says which key that form already made.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import CreatedKeyOut, KeyCreate, KeyRotate
from gateway.admin.service import keys as key_service
from gateway.admin.service import tenants as tenant_service
from gateway.console.form_nonces import (
    NONCE_FIELD,
    FormAlreadyUsed,
    FormExpired,
    one_time_forms,
)
from gateway.console.pages import CallerDep, ConsoleRoute, Form, FormDep, FormErrors, redirect
from gateway.console.tenant_pages import create_key_scope, render_tenant, rotate_key_scope
from gateway.errors import APIError
from gateway.http.deps import StateDep
from gateway.state import GatewayState

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

KeyId = Annotated[str, Path(min_length=1, max_length=32)]
KEY_FIELDS = {"name", "role", "expires_at"}
EXPIRED_FORM = (
    "This form has expired (or came from another gateway or before a restart); nothing was "
    "done. Check it and send it again."
)


@router.post("/tenants/{tenant_id}/keys")
def create_key(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Create a key and show its secret on this answer, once; the same form never makes two."""

    def make() -> CreatedKeyOut:
        return key_service.create_key(state, caller, tenant_id, form.body(KeyCreate))

    def refused(error: APIError) -> FormErrors:
        return FormErrors.of(error, {}, KEY_FIELDS)

    scope = create_key_scope(tenant_id)
    return _make_key_once(request, caller, state, tenant_id, form, scope, "key", make, refused)


@router.post("/tenants/{tenant_id}/keys/{key_id}/revoke")
def revoke_key(
    tenant_id: uuid.UUID, key_id: KeyId, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Revoke a key: the next request with it is refused."""
    key_service.revoke_key(state, caller, tenant_id, key_id)
    return redirect(f"/admin/tenants/{tenant_id}", done="key_revoked")


@router.post("/tenants/{tenant_id}/keys/{key_id}/rotate")
def rotate_key(
    request: Request,
    tenant_id: uuid.UUID,
    key_id: KeyId,
    caller: CallerDep,
    form: FormDep,
    state: StateDep,
) -> Response:
    """Issue a successor (its secret shown once); the old key works through the grace time."""

    def make() -> CreatedKeyOut:
        return key_service.rotate_key(state, caller, tenant_id, key_id, form.body(KeyRotate))

    def refused(error: APIError) -> FormErrors:
        return FormErrors(form=f"{key_id}: {error.message}")

    scope = rotate_key_scope(tenant_id, key_id)
    return _make_key_once(request, caller, state, tenant_id, form, scope, "rotate", make, refused)


def _make_key_once(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    tenant_id: uuid.UUID,
    form: Form,
    scope: str,
    failed: str,
    make: Callable[[], CreatedKeyOut],
    refused: Callable[[APIError], FormErrors],
) -> Response:
    """Run `make` once for the form's nonce and show the new key's secret.

    A refusal (or an expired form) shows the `failed` form again with `refused(error)`.
    """
    tenant_service.show_tenant(state, caller, tenant_id)  # another tenant's is a 404, first
    try:
        with one_time_forms(request).single_use(form.get(NONCE_FIELD), scope) as claim:
            created = make()
            claim.made = _described(created)
    except FormAlreadyUsed as used:
        return _posted_twice(request, caller, state, tenant_id, used)
    except (FormExpired, APIError) as problem:
        error = problem if isinstance(problem, APIError) else APIError.conflict(EXPIRED_FORM)
        if error.status not in (400, 409):
            raise
        errors = refused(error)
        return render_tenant(
            request, caller, state, tenant_id, failed, errors, form.values, None, error.status
        )
    return render_tenant(request, caller, state, tenant_id, new_key=created)


def _described(key: CreatedKeyOut) -> str:
    """How an answer names a key a form made (never its secret)."""
    return f"Key {key.key_id} “{key.name}”"


def _posted_twice(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    tenant_id: uuid.UUID,
    used: FormAlreadyUsed,
) -> Response:
    """The answer to a single-use form posted again: what it made, and that no more was made."""
    if used.made is None:
        repeated = "This form was already sent and its key is still being made; no second key "
        repeated += "was made."
    else:
        repeated = (
            f"{used.made} was already created by this form; its secret is not shown again, "
            "and no second key was made. If nobody copied the secret, revoke that key and "
            "make another."
        )
    return render_tenant(request, caller, state, tenant_id, status=409, repeated=repeated)
