"""The tenants table and a tenant's page: usage, limits and sharing, scheduling weight, cache
quota, status.

The table lists live tenants with a bar of cache blocks held against the quota and the hit
ratio, searchable and paged. A tenant's page shows its cache now and over the last minutes (a
chart that `static/chart.js` refreshes from `usage.json` every 2 s), its scheduling weight
beside the share of the engine's service it got over those minutes (to an operator only: the
share would tell a tenant-admin what the other tenants got), its keys, and the forms that
change it. Every change is the admin service's function (`gateway.admin.service.tenants`)
that the admin API calls too: the same validation, the same audit event, the same effect on the
engine. Suspend, resume and delete go through a confirmation page first. A quota saved in tokens
comes back in tokens; the second tier's quota and reservation sit beside the pool's in the same
form (gateway/console/quota_form.py). The tenants table's hit ratio and prompt tokens are the
last minutes' (the usage window), as the tenant's page shows them; "—" where there was no prompt
to hit.
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import CreatedKeyOut, KeyOut, TenantCreate, TenantUpdate
from gateway.admin.service import keys as key_service
from gateway.admin.service import tenants as tenant_service
from gateway.admin.service import usage as usage_service
from gateway.console.form_nonces import one_time_forms
from gateway.console.pages import (
    CallerDep,
    ConsoleRoute,
    Form,
    FormDep,
    FormErrors,
    flash_of,
    redirect,
    render,
)
from gateway.console.quota_form import (
    BYTE_UNITS,
    QUOTA_FIELDS,
    QUOTA_PARAMS,
    UNITS,
    pool_unit,
    quota_body,
    saved_units,
    tier_amount,
)
from gateway.errors import APIError
from gateway.http.deps import StateDep
from gateway.state import GatewayState
from tenancy.tenants import weight_text

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

PAGE_SIZE = 25
CREATE_FIELDS = {"slug", "display_name", "cache_quota_blocks", "sharing_mode"}
SETTINGS_FIELDS = {
    "display_name",
    "sharing_mode",
    "may_use_public_prefixes",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
}
SCHEDULING_FIELDS = {"scheduling_weight"}
# The forms that change a tenant's settings (the API's update): their fields, those that must
# not be empty (an empty field is left out of the update, which would change nothing), and
# what each says it did.
UPDATE_FORMS = {
    "settings": (SETTINGS_FIELDS, {"display_name"}, "tenant_updated"),
    "scheduling": (SCHEDULING_FIELDS, SCHEDULING_FIELDS, "weight_set"),
}
# Confirmed actions: what the confirmation page says, and what is done after it.
STATUS_ACTIONS = {
    "suspend": (
        "Suspend",
        "Its API keys stop working at once (within a second in other gateways). Its cached "
        "blocks and settings stay; you can resume it later.",
    ),
    "resume": ("Resume", "Its API keys work again."),
    "delete": (
        "Delete",
        "Its keys are revoked, its cached KV blocks are purged and zeroed, its data key is "
        "destroyed (whatever of it the second KV tier holds is unreadable at once), and it "
        "disappears from the console. The audit trail stays. This cannot be undone.",
    ),
}


@router.get("/tenants")
def tenants_page(
    request: Request,
    caller: CallerDep,
    state: StateDep,
    q: Annotated[str, Query(max_length=100)] = "",
    page: Annotated[int, Query(ge=1, le=1_000_000)] = 1,
) -> Response:
    """Live tenants, searchable by slug or name, `PAGE_SIZE` to a page."""
    return _tenants_page(request, caller, state, q, page)


@router.post("/tenants")
def create_tenant(request: Request, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """Create a tenant and open its page."""
    try:
        created = tenant_service.create_tenant(state, caller, form.body(TenantCreate))
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, {}, CREATE_FIELDS)
        return _tenants_page(request, caller, state, "", 1, errors, form.values, error.status)
    return redirect(f"/admin/tenants/{created.id}", done="tenant_created")


@router.get("/tenants/{tenant_id}")
def tenant_page(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, state: StateDep
) -> Response:
    """One tenant: its cache now and over time, its keys, limits, quota and status."""
    return render_tenant(request, caller, state, tenant_id)


@router.post("/tenants/{tenant_id}/settings")
def update_settings(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Change the display name, sharing mode, public-prefix use and request limits."""
    return _update_tenant(request, tenant_id, caller, form, state, "settings")


@router.post("/tenants/{tenant_id}/scheduling")
def set_scheduling_weight(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Change the scheduling weight (the tenant's next request carries it)."""
    weight = Form({"scheduling_weight": form.get("scheduling_weight")})
    return _update_tenant(request, tenant_id, caller, weight, state, "scheduling")


@router.post("/tenants/{tenant_id}/quota")
def set_quota(
    request: Request, tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Set the cache quota and/or reservation, each in blocks or tokens."""
    try:
        tenant_service.set_quota(state, caller, tenant_id, quota_body(form))
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, QUOTA_PARAMS, QUOTA_FIELDS)
        return render_tenant(
            request, caller, state, tenant_id, "quota", errors, form.values, None, error.status
        )
    # The page shows the form again in the units the operator used.
    units = saved_units(form)
    return redirect(f"/admin/tenants/{tenant_id}", done="quota_set", details=units)


@router.get("/tenants/{tenant_id}/confirm")
def confirm_page(
    request: Request,
    tenant_id: uuid.UUID,
    caller: CallerDep,
    state: StateDep,
    action: Annotated[str, Query(pattern="^(suspend|resume|delete)$")],
) -> Response:
    """Ask before suspending, resuming or deleting a tenant."""
    caller.require_admin()
    tenant = tenant_service.show_tenant(state, caller, tenant_id)
    verb, consequence = STATUS_ACTIONS[action]
    return render(
        request,
        "confirm.html",
        title=f"{verb} {tenant.slug}?",
        tenant=tenant,
        action=action,
        verb=verb,
        consequence=consequence,
    )


@router.post("/tenants/{tenant_id}/suspend")
def suspend(tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """Suspend the tenant, once confirmed."""
    return _confirmed(tenant_id, "suspend", caller, form, state)


@router.post("/tenants/{tenant_id}/resume")
def resume(tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """Resume the tenant, once confirmed."""
    return _confirmed(tenant_id, "resume", caller, form, state)


@router.post("/tenants/{tenant_id}/delete")
def delete(tenant_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """Delete the tenant, once confirmed."""
    return _confirmed(tenant_id, "delete", caller, form, state)


def create_key_scope(tenant_id: uuid.UUID) -> str:
    """What the single-use "create a key" form of this tenant does (its nonce's scope)."""
    return f"create-key:{tenant_id}"


def rotate_key_scope(tenant_id: uuid.UUID, key_id: str) -> str:
    """What the single-use "rotate" form of one key does (its nonce's scope)."""
    return f"rotate-key:{tenant_id}:{key_id}"


def render_tenant(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    tenant_id: uuid.UUID,
    failed: str | None = None,
    errors: FormErrors | None = None,
    submitted: dict[str, str] | None = None,
    new_key: CreatedKeyOut | None = None,
    status: int = 200,
    repeated: str | None = None,
) -> Response:
    """The tenant's page; `failed` names a form to show again with `errors` and its values.

    A new key's secret (`new_key`) is shown on this answer only; `repeated` says what a
    single-use key form posted again had already made. Each key form gets a fresh nonce.
    """
    tenant = tenant_service.show_tenant(state, caller, tenant_id)
    keys: list[KeyOut] = key_service.list_keys(state, caller, tenant_id)
    usage = usage_service.tenant_usage(state, caller, tenant_id, usage_service.DEFAULT_WINDOW_S)
    spec = state.engine.pool.spec
    forms = one_time_forms(request)
    create_nonce = forms.issue(create_key_scope(tenant_id))
    rotate_nonces = {
        key.key_id: forms.issue(rotate_key_scope(tenant_id, key.key_id))
        for key in keys
        if key.state == "active"
    }
    flash = flash_of(request)
    quota_unit = pool_unit(flash.get("quota_unit"))
    reservation_unit = pool_unit(flash.get("reservation_unit"))
    tier_quota = tier_amount(tenant.tier_quota_bytes, flash.get("tier_quota_unit"))
    tier_reservation = tier_amount(
        tenant.tier_reservation_bytes, flash.get("tier_reservation_unit")
    )
    values: dict[str, dict[str, Any]] = {
        "settings": {
            "display_name": tenant.display_name,
            "sharing_mode": tenant.sharing_mode,
            "may_use_public_prefixes": "true" if tenant.may_use_public_prefixes else "false",
            "requests_per_minute": tenant.requests_per_minute,
            "tokens_per_minute": tenant.tokens_per_minute,
            "max_concurrent": tenant.max_concurrent,
        },
        "scheduling": {"scheduling_weight": weight_text(tenant.scheduling_weight)},
        "quota": {
            "quota": getattr(tenant.quota, quota_unit),
            "quota_unit": quota_unit,
            "reservation": getattr(tenant.reservation, reservation_unit),
            "reservation_unit": reservation_unit,
            "tier_quota": tier_quota[0],
            "tier_quota_unit": tier_quota[1],
            "tier_reservation": tier_reservation[0],
            "tier_reservation_unit": tier_reservation[1],
        },
        "key": {"name": "", "role": "inference", "expires_at": ""},
        "rotate": {"grace_seconds": 86_400},
    }
    if failed is not None and submitted is not None:
        values[failed].update({k: v for k, v in submitted.items() if k in values[failed]})
    return render(
        request,
        "tenant.html",
        status,
        title=f"Tenant {tenant.slug}",
        tenant=tenant,
        keys=keys,
        window=usage.summary,
        window_minutes=usage.window_s // 60,
        new_key=new_key,
        repeated=repeated,
        create_nonce=create_nonce,
        rotate_nonces=rotate_nonces,
        values=values,
        errors={failed: errors} if failed is not None and errors is not None else {},
        block_size=spec.block_size,
        bytes_per_block=spec.bytes_per_block,
        pool_blocks=state.engine.pool.num_blocks,
        units=UNITS,
        byte_units=[(unit, unit) for unit in reversed(BYTE_UNITS)],  # B first
    )


def _update_tenant(
    request: Request,
    tenant_id: uuid.UUID,
    caller: AdminCaller,
    form: Form,
    state: GatewayState,
    name: str,
) -> Response:
    """Apply the form `name` (the admin API's tenant update); a refusal shows it again."""
    fields, required, done = UPDATE_FORMS[name]
    try:
        empty = sorted(field for field in required if not form.get(field).strip())
        if empty:
            raise APIError.invalid(f"{empty[0]}: a value is required", empty[0])
        tenant_service.update_tenant(state, caller, tenant_id, form.body(TenantUpdate))
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, {}, fields)
        return render_tenant(
            request, caller, state, tenant_id, name, errors, form.values, None, error.status
        )
    return redirect(f"/admin/tenants/{tenant_id}", done=done)


def _confirmed(
    tenant_id: uuid.UUID, action: str, caller: AdminCaller, form: Form, state: GatewayState
) -> Response:
    """Do a status action the operator confirmed; without confirmation, ask first."""
    if form.get("confirmed") != "yes":
        return redirect(f"/admin/tenants/{tenant_id}/confirm", action=action)
    if action == "delete":
        tenant_service.delete_tenant(state, caller, tenant_id)
        return redirect("/admin/tenants", done="tenant_deleted")
    if action == "suspend":
        tenant_service.suspend_tenant(state, caller, tenant_id)
    else:
        tenant_service.resume_tenant(state, caller, tenant_id)
    return redirect(f"/admin/tenants/{tenant_id}", done=f"tenant_{action}d")


def _tenants_page(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    q: str,
    page: int,
    errors: FormErrors | None = None,
    submitted: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    offset = (page - 1) * PAGE_SIZE
    listed = tenant_service.list_tenants(state, caller, q, PAGE_SIZE, offset)
    # The same page of tenants, for what each did in the usage window (hit ratio, prompts).
    usage = usage_service.usage_table(
        state, caller, usage_service.DEFAULT_WINDOW_S, q, PAGE_SIZE, offset
    )
    windows = {row.tenant_id: row.summary for row in usage.data}
    pages = max(1, math.ceil(listed.total / PAGE_SIZE))
    create = {"slug": "", "display_name": "", "cache_quota_blocks": "", "sharing_mode": "user"}
    if submitted is not None:
        create.update({k: v for k, v in submitted.items() if k in create})
    return render(
        request,
        "tenants.html",
        status,
        title="Tenants",
        listed=listed,
        windows=windows,
        window_minutes=usage.window_s // 60,
        q=q,
        page=page,
        pages=pages,
        create=create,
        errors=errors or FormErrors(),
        pool_blocks=state.engine.pool.num_blocks,
    )
