"""Public prefixes under /admin/api/prefixes: list, add, show, enable/disable, delete.

Only an admin manages them; a change applies to this process before the answer
(gateway/admin/service/prefixes.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import PrefixCreate, PrefixOut, PrefixUpdate
from gateway.admin.service import prefixes
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES

router = APIRouter(
    prefix="/admin/api/prefixes", tags=["admin: public prefixes"], responses=ADMIN_RESPONSES
)


@router.get("")
def list_prefixes(caller: AdminDep, state: StateDep) -> list[PrefixOut]:
    """Every registered prefix, by model, namespace and name."""
    return prefixes.list_prefixes(state, caller)


@router.post("", status_code=201)
def add_prefix(
    body: Annotated[PrefixCreate, Body()], caller: AdminDep, state: StateDep
) -> PrefixOut:
    """Register a system prompt to share across tenants (model default: the served one, when
    the gateway serves exactly one)."""
    return prefixes.add_prefix(state, caller, body)


@router.get("/{prefix_id}")
def show_prefix(prefix_id: uuid.UUID, caller: AdminDep, state: StateDep) -> PrefixOut:
    """One registered prefix."""
    return prefixes.show_prefix(state, caller, prefix_id)


@router.patch("/{prefix_id}")
def update_prefix(
    prefix_id: uuid.UUID, body: Annotated[PrefixUpdate, Body()], caller: AdminDep, state: StateDep
) -> PrefixOut:
    """Enable or disable a prefix; disabling drops its cached blocks."""
    return prefixes.update_prefix(state, caller, prefix_id, body)


@router.delete("/{prefix_id}", status_code=204)
def delete_prefix(prefix_id: uuid.UUID, caller: AdminDep, state: StateDep) -> None:
    """Delete a prefix; its cached blocks are dropped and its data key shredded."""
    prefixes.delete_prefix(state, caller, prefix_id)
