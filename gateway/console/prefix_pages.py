"""The public prefixes page: the system prompts every tenant may share, for admins only.

Each prefix shows what it shares for the served model (tokens and whole KV blocks, counted
with the chat template's system turn around the text) and the admin API's warning when it is
too short to be shared at all. An enabled prefix that is not shared says so in its state, and
adding or enabling one ends in a warning that says why instead of a plain success. Adding,
enabling, disabling and deleting are the admin service's functions (`gateway.admin.service
.prefixes`): the sharing policy is rebuilt and a withdrawn prefix's cached blocks are dropped
before the page answers.
Deleting asks for confirmation first.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import PrefixCreate, PrefixOut, PrefixUpdate
from gateway.admin.service import prefixes as prefix_service
from gateway.console.pages import (
    CallerDep,
    ConsoleRoute,
    FormDep,
    FormErrors,
    Notice,
    flash_of,
    redirect,
    render,
)
from gateway.errors import APIError
from gateway.http.deps import StateDep
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
        added = prefix_service.add_prefix(state, caller, form.body(PrefixCreate))
    except APIError as error:
        if error.status not in (400, 409):
            raise
        errors = FormErrors.of(error, {}, PREFIX_FIELDS)
        return _prefixes_page(request, caller, state, errors, form.values, error.status)
    return _done(added, state, "prefix_added")


@router.post("/prefixes/{prefix_id}/enable")
def enable_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    enabled = prefix_service.update_prefix(state, caller, prefix_id, PrefixUpdate(enabled=True))
    return _done(enabled, state, "prefix_enabled")


@router.post("/prefixes/{prefix_id}/disable")
def disable_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    prefix_service.update_prefix(state, caller, prefix_id, PrefixUpdate(enabled=False))
    return redirect("/admin/prefixes", done="prefix_disabled")


@router.get("/prefixes/{prefix_id}/delete")
def confirm_delete(
    request: Request, prefix_id: uuid.UUID, caller: CallerDep, state: StateDep
) -> Response:
    """Ask before deleting a prefix."""
    prefix = prefix_service.show_prefix(state, caller, prefix_id)
    return render(request, "prefix_delete.html", title=f"Delete {prefix.name}?", prefix=prefix)


@router.post("/prefixes/{prefix_id}/delete")
def delete_prefix(
    prefix_id: uuid.UUID, caller: CallerDep, form: FormDep, state: StateDep
) -> Response:
    """Delete a prefix once confirmed (its cached blocks are dropped)."""
    if form.get("confirmed") != "yes":
        return redirect(f"/admin/prefixes/{prefix_id}/delete")
    prefix_service.delete_prefix(state, caller, prefix_id)
    return redirect("/admin/prefixes", done="prefix_deleted")


def not_shared_because(prefix: PrefixOut, state: GatewayState) -> str | None:
    """Why the prefix would share nothing here (a model not served, too short), or None."""
    if prefix.tokens is None:
        return "model not served"
    if prefix.blocks is not None and prefix.blocks < state.models.min_public_blocks:
        return "too short"
    return None


def _done(prefix: PrefixOut, state: GatewayState, done: str) -> Response:
    """Back to the list, saying what was done; a warning (naming the prefix) if it won't share."""
    if not_shared_because(prefix, state) is None:
        return redirect("/admin/prefixes", done=done)
    return redirect("/admin/prefixes", done=f"{done}_unshared", details={"prefix": str(prefix.id)})


def _unshared_notice(
    request: Request, listed: list[PrefixOut], state: GatewayState
) -> Notice | None:
    """The warning after adding or enabling a prefix that will not be shared, saying why."""
    flash = flash_of(request)
    done = flash.get("done", "")
    if done not in ("prefix_added_unshared", "prefix_enabled_unshared"):
        return None
    verb = "added" if done == "prefix_added_unshared" else "enabled"
    asked = flash.get("prefix", "")
    prefix = next((p for p in listed if str(p.id) == asked), None)
    if prefix is None:
        return Notice(f"Public prefix {verb}, but it will not be shared.", "warning")
    minimum = state.models.min_public_blocks
    name = f"{prefix.namespace} / {prefix.name}"
    if prefix.tokens is None or prefix.blocks is None:
        served = ", ".join(state.models.names()) or "no model right now"
        why = f"it is for {prefix.model}, and this gateway serves {served}"
    else:
        block_size = state.settings.block_size
        why = (
            f"its {prefix.tokens:,} tokens (the system turn as the chat template writes it) "
            f"make {prefix.blocks} whole blocks of {block_size}, and a prefix is shared from "
            f"{minimum} blocks ({minimum * block_size:,} tokens) on. Lengthen its text or "
            "disable it"
        )
    return Notice(f"Public prefix {name} {verb}, but it will not be shared: {why}.", "warning")


def _prefixes_page(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    errors: FormErrors | None = None,
    submitted: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    listed = prefix_service.list_prefixes(state, caller)
    values = {"namespace": "default", "name": "", "text": "", "model": ""}
    if submitted is not None:
        values.update({k: v for k, v in submitted.items() if k in values})
    return render(
        request,
        "prefixes.html",
        status,
        title="Public prefixes",
        prefixes=[(prefix, not_shared_because(prefix, state)) for prefix in listed],
        values=values,
        errors=errors or FormErrors(),
        model_names=state.models.names(),
        min_public_blocks=state.models.min_public_blocks,
        block_size=state.settings.block_size,
        notice=_unshared_notice(request, listed, state),
    )
