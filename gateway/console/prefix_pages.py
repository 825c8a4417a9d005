"""The public prefixes page: the system prompts every tenant may share, for admins only.

Each prefix shows what it shares for the served model (tokens and whole KV blocks) and the
admin API's warning when it is too short to be shared at all. Adding, enabling, disabling and
deleting are the admin API's own functions (`gateway.api.routes.admin.prefixes`): the sharing
policy is rebuilt and a withdrawn prefix's cached blocks are dropped before the page answers.
Deleting asks for confirmation first.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import PrefixCreate, PrefixUpdate
from gateway.api.deps import StateDep
from gateway.api.routes.admin import prefixes as prefixes_api
from gateway.console.pages import CallerDep, ConsoleRoute, FormDep, FormErrors, redirect, render
from gateway.errors import APIError
from gateway.state import GatewayState

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

PREFIX_FIELDS = {"namespace", "name", "text", "model"}


@router.get("/prefixes")
def prefixes_page(request: Request, caller: CallerDep, state: StateDep) -> Response:
    """Every registered prefix, and the form that adds one."""
    return _prefixes_page(request, caller, state)


@router.post("/prefixes")
def add_prefix(request: Request, caller: CallerDep, form: FormDep, state: StateDep) -> Response:
    """Register a prefix; refused input comes back with the message by its field."""
    try:
        prefixes_api.add_prefix(form.body(PrefixCreate), caller, state)
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, {}, PREFIX_FIELDS)
        return _prefixes_page(request, caller, state, errors, form.values, error.status)
    return redirect("/admin/prefixes", done="prefix_added")


@router.post("/prefixes/{prefix_id}/enable")
def enable_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    prefixes_api.update_prefix(prefix_id, PrefixUpdate(enabled=True), caller, state)
    return redirect("/admin/prefixes", done="prefix_enabled")


@router.post("/prefixes/{prefix_id}/disable")
def disable_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    prefixes_api.update_prefix(prefix_id, PrefixUpdate(enabled=False), caller, state)
    return redirect("/admin/prefixes", done="prefix_disabled")


@router.get("/prefixes/{prefix_id}/delete")
def confirm_delete(
    request: Request, prefix_id: uuid.UUID, caller: CallerDep, state: StateDep
) -> Response:
    """Ask before deleting a prefix."""
    prefix = prefixes_api.show_prefix(prefix_id, caller, state)
    return render(request, "prefix_delete.html", title=f"Delete {prefix.name}?", prefix=prefix)


@router.post("/prefixes/{prefix_id}/delete")
def delete_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Delete a prefix once confirmed (its cached blocks are dropped)."""
    if form.get("confirmed") != "yes":
        return redirect(f"/admin/prefixes/{prefix_id}/delete")
    prefixes_api.delete_prefix(prefix_id, caller, state)
    return redirect("/admin/prefixes", done="prefix_deleted")


def _prefixes_page(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    errors: FormErrors | None = None,
    submitted: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    listed = prefixes_api.list_prefixes(caller, state)
    values = {"namespace": "default", "name": "", "text": "", "model": ""}
    if submitted is not None:
        values.update({k: v for k, v in submitted.items() if k in values})
    return render(
        request,
        "prefixes.html",
        status,
        title="Public prefixes",
        prefixes=listed,
        values=values,
        errors=errors or FormErrors(),
        model_name=state.model_name,
        min_public_blocks=state.sharing.min_public_blocks,
        block_size=state.settings.block_size,
    )
