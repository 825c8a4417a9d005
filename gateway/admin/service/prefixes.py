"""Public prefixes: list, add, show, enable/disable, delete.

A public prefix is a system prompt of one model whose KV blocks every tenant may reuse, so
only an admin manages them (a tenant-admin gets 403). Each answer shows what the prefix shares
for its model when this gateway serves that model: its tokens, its whole blocks, and a warning
when it is too short to be shared. A change applies to this process before the answer: the
model's sharing policy is rebuilt, and a disabled or deleted prefix's cached blocks are dropped
(and zeroed) in that model's pool, so no request after the answer gets a public hit on it. A
deleted prefix's data key is shredded in the same transaction (its blocks in a second tier are
unreadable at once); the event says whether there was one (`data_key_shredded`).
Other gateways rebuild their policy within `registry_refresh_s`; there the old blocks are no
longer planned as public, so they are never matched again and age out of the cache.

Audit events hold the prefix's namespace, name and model and a SHA-256 of its text, not the
text (up to 200,000 characters).
"""

from __future__ import annotations

import hashlib
import uuid

from sqlalchemy.orm import Session

from gateway.admin.audited_change import Action, Changed, apply_change
from gateway.admin.callers import AdminCaller
from gateway.admin.outputs import prefix_out
from gateway.admin.schemas import PrefixCreate, PrefixOut, PrefixUpdate
from gateway.errors import APIError, from_tenancy_error
from gateway.state import GatewayState
from policies.templates import system_prompt_tokens
from tenancy import prefixes
from tenancy.errors import NotFound
from tenancy.models import PublicPrefix


def list_prefixes(state: GatewayState, caller: AdminCaller) -> list[PrefixOut]:
    """Every registered prefix, by model, namespace and name (admins only)."""
    caller.require_admin()
    with state.store.transaction() as session:
        return [prefix_out(state, prefix) for prefix in prefixes.list_prefixes(session)]


def add_prefix(state: GatewayState, caller: AdminCaller, body: PrefixCreate) -> PrefixOut:
    """Register a system prompt to share across tenants (model default: the served one, when
    the gateway serves exactly one)."""
    model = body.model or state.models.default_name()
    if model is None:
        served = ", ".join(state.models.names()) or "no model right now"
        raise APIError.invalid(f"name the model: this gateway serves {served}", "model")

    def change(session: Session) -> Changed[PrefixOut]:
        prefix = prefixes.add_prefix(
            session, model, body.namespace, body.name, body.text, caller.actor_id
        )
        return Changed(prefix_out(state, prefix), None, None, _audit_view(prefix))

    resource = f"{model}/{body.namespace}/{body.name}"
    added = apply_change(
        state, caller, Action("prefix.create", "public_prefix", resource, admin_only=True), change
    )
    state.models.refresh_registries()  # this process shares it from the next request on
    return added


def show_prefix(state: GatewayState, caller: AdminCaller, prefix_id: uuid.UUID) -> PrefixOut:
    """One registered prefix (admins only)."""
    caller.require_admin()
    with state.store.transaction() as session:
        try:
            prefix = prefixes.get_prefix_by_id(session, prefix_id)
        except NotFound as error:
            raise from_tenancy_error(error) from error
        return prefix_out(state, prefix)


def update_prefix(
    state: GatewayState, caller: AdminCaller, prefix_id: uuid.UUID, body: PrefixUpdate
) -> PrefixOut:
    """Enable or disable a prefix; disabling drops its cached blocks."""

    def change(session: Session) -> Changed[PrefixOut]:
        before = _audit_view(prefixes.get_prefix_by_id(session, prefix_id))
        prefix = prefixes.set_enabled_by_id(session, prefix_id, body.enabled)
        return Changed(prefix_out(state, prefix), None, before, _audit_view(prefix))

    action = "prefix.enable" if body.enabled else "prefix.disable"
    updated = apply_change(
        state, caller, Action(action, "public_prefix", str(prefix_id), admin_only=True), change
    )
    state.models.refresh_registries()
    if not updated.enabled:
        _drop_blocks(state, updated.model, updated.namespace, updated.text)
    return updated


def delete_prefix(state: GatewayState, caller: AdminCaller, prefix_id: uuid.UUID) -> None:
    """Delete a prefix; its cached blocks are dropped and its data key shredded."""

    def change(session: Session) -> Changed[tuple[str, str, str]]:
        prefix = prefixes.get_prefix_by_id(session, prefix_id)
        before, deleted = _audit_view(prefix), (prefix.model, prefix.namespace, prefix.text)
        shredded = prefixes.delete_prefix_by_id(session, prefix_id)
        return Changed(deleted, None, before, None, {"data_key_shredded": shredded})

    action = Action("prefix.delete", "public_prefix", str(prefix_id), admin_only=True)
    model, namespace, text = apply_change(state, caller, action, change)
    state.models.refresh_registries()
    _drop_blocks(state, model, namespace, text)


def _drop_blocks(state: GatewayState, model: str, namespace: str, text: str) -> None:
    """Drop (and zero) the cached public blocks of a withdrawn prefix, in its model's pool.

    Called after the policy was rebuilt without it, so that no request planned from then on
    caches those blocks as public again.
    """
    served = state.models.get(model)
    if served is None or served.loaded.tokenizer is None:
        return
    tokens = system_prompt_tokens(served.loaded.tokenizer, text)
    served.engine.drop_public_prefix(namespace, tokens)


def _audit_view(prefix: PublicPrefix) -> dict[str, object]:
    """The prefix as its audit events record it: a digest of its text, never the text."""
    return {
        "namespace": prefix.namespace,
        "name": prefix.name,
        "model": prefix.model,
        "enabled": prefix.enabled,
        "text_sha256": hashlib.sha256(prefix.text.encode()).hexdigest(),
        "text_chars": len(prefix.text),
    }
