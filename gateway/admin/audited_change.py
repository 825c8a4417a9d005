"""The one way an admin call changes anything: one transaction, one audit event, applied now.

`apply_change` runs the change in a transaction and records exactly one audit event for it,
whatever the outcome: who (operator or tenant-admin key, and from where), what (action and
resource), the resource before and after, and what else the change did (a deletion's
`data_key_shredded`). A refused change (a tenancy rule, a tenant the
caller may not see) is audited as a failure and answered in the API's error shape. After a
successful commit this process applies it at once (`TenancySync.poll`: key checks forgotten,
cache budgets set in the engine, a deleted tenant's blocks purged); other gateways are notified
by the database as it commits (PostgreSQL; tenancy/change_feed.py), or see it on their next poll
(`tenancy_poll_s`, 1 s by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, TypeVar

from sqlalchemy.orm import Session

from gateway.admin.callers import ADMIN_ONLY, AdminCaller
from gateway.errors import APIError, from_tenancy_error
from gateway.state import GatewayState
from tenancy.audit_chain import AuditRecord
from tenancy.errors import TenancyError

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Changed(Generic[T]):
    """What a change did: its result for the caller, and the audit event's view of it."""

    result: T
    tenant_id: str | None = None
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    # What else the change did, beside `before` and `after` in the event's details.
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Action:
    """What is being changed, as the audit event names it."""

    name: str  # e.g. "tenant.update"
    resource_type: str
    resource_id: str
    tenant_id: str | None = None  # known before the change (for a refusal's event)
    admin_only: bool = False  # refused (403, audited) for a tenant-admin


def apply_change(
    state: GatewayState,
    caller: AdminCaller,
    action: Action,
    change: Callable[[Session], Changed[T]],
) -> T:
    """Run `change` in one transaction, audit it, and apply it to this process at once.

    Blocking (database, engine): call it from a threadpool (sync routes are).
    """
    if action.admin_only and not caller.is_admin:
        refuse(state, caller, action, APIError.forbidden(ADMIN_ONLY))
    wait = state.admin_changes.admit(f"{caller.actor_type}:{caller.actor_id}")
    if wait is not None:
        message = f"more than {state.admin_changes.per_minute} changes a minute; slow down"
        refuse(state, caller, action, APIError.rate_limited(message, wait))
    try:
        with state.store.transaction() as session:
            changed = change(session)
    except (TenancyError, APIError) as error:
        api_error = error if isinstance(error, APIError) else from_tenancy_error(error)
        _audit(state, caller, action, "failure", action.tenant_id, {"error": api_error.message})
        raise api_error from error
    details = {"before": changed.before, "after": changed.after, **changed.details}
    _audit(state, caller, action, "success", changed.tenant_id or action.tenant_id, details)
    try:
        state.tenancy_sync.poll()
    except Exception:  # committed and audited: the background poll applies it within a second
        logger.warning("could not apply %s to this process at once", action.name, exc_info=True)
    return changed.result


def refuse(state: GatewayState, caller: AdminCaller, action: Action, error: APIError) -> NoReturn:
    """Refuse a change before it starts: audited as a failure, like one `apply_change` refuses."""
    _audit(state, caller, action, "failure", action.tenant_id, {"error": error.message})
    raise error


def _audit(
    state: GatewayState,
    caller: AdminCaller,
    action: Action,
    outcome: str,
    tenant_id: str | None,
    details: dict[str, Any],
) -> None:
    if not caller.sees(tenant_id):  # a refused reach into another tenant stays in one's own log
        tenant_id = None if caller.tenant_id is None else str(caller.tenant_id)
    state.store.record(
        AuditRecord(
            actor_type=caller.actor_type,
            actor_id=caller.actor_id,
            tenant_id=tenant_id,
            action=action.name,
            resource_type=action.resource_type,
            resource_id=action.resource_id,
            outcome=outcome,
            source_ip=caller.source_ip,
            details={**details, "role": caller.role},
        )
    )
