"""A tenant's API keys on its page: create, revoke, rotate.

These are the admin API's own key functions (`gateway.api.routes.admin.keys`), so a
tenant-admin manages its own tenant's keys here as it can through the API, and nobody else's.
A new key's secret (from a creation or a rotation) is rendered into the answer to that POST,
once: it is not stored, the page is never cached (`Cache-Control: no-store`), and reloading
the tenant's page shows only the key's public id.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from gateway.admin.schemas import KeyCreate, KeyRotate
from gateway.api.deps import StateDep
from gateway.api.routes.admin import keys as keys_api
from gateway.console.pages import CallerDep, ConsoleRoute, FormDep, FormErrors, redirect
from gateway.console.tenant_pages import render_tenant
from gateway.errors import APIError

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

KeyId = Annotated[str, Path(min_length=1, max_length=32)]
KEY_FIELDS = {"name", "role", "expires_at"}


@router.post("/tenants/{tenant_id}/keys")
def create_key(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Create a key and show its secret on this answer, once."""
    try:
        created = keys_api.create_key(tenant_id, form.body(KeyCreate), caller, state)
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, {}, KEY_FIELDS)
        return render_tenant(
            request, caller, state, tenant_id, "key", errors, form.values, None, error.status
        )
    return render_tenant(request, caller, state, tenant_id, new_key=created)


@router.post("/tenants/{tenant_id}/keys/{key_id}/revoke")
def revoke_key(
    tenant_id: uuid.UUID, key_id: KeyId, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Revoke a key: the next request with it is refused."""
    keys_api.revoke_key(tenant_id, key_id, caller, state)
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
    try:
        created = keys_api.rotate_key(tenant_id, key_id, form.body(KeyRotate), caller, state)
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors(form=f"{key_id}: {error.message}")
        return render_tenant(
            request, caller, state, tenant_id, "rotate", errors, form.values, None, error.status
        )
    return render_tenant(request, caller, state, tenant_id, new_key=created)
