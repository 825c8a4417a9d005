"""Audit events as an admin reads them: one filter for search and export, narrowed to what the
caller may see, and pages of events.

Search and export take the same filters (tenant, action or action prefix `tenant.*`, outcome,
since/until) and select through one `AuditFilter`, so a download holds exactly the events the
search pages through. A tenant-admin reads its own tenant's events only: its filter is forced
to its tenant, another tenant's id is the same 404 as a missing one, and events of no tenant
(logins, global changes) are never its.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from gateway.admin.callers import AdminCaller, visible_tenant
from gateway.errors import from_tenancy_error
from gateway.state import GatewayState
from tenancy import audit_search
from tenancy.audit_search import AuditFilter
from tenancy.errors import TenancyError
from tenancy.models import AuditEvent


class AuditEventOut(BaseModel):
    seq: int
    event_id: uuid.UUID
    time: datetime
    actor_type: str
    actor_id: str | None
    tenant_id: str | None
    action: str
    resource_type: str | None
    resource_id: str | None
    outcome: str
    request_id: str | None
    source_ip: str | None
    details: dict[str, Any]


class AuditEventPage(BaseModel):
    data: list[AuditEventOut]
    next_cursor: int | None = Field(
        description="For the next page, pass this as before_seq (or as after_seq when paging "
        "with after_seq); null when there are no more events"
    )


def audit_selection(
    *,
    tenant_id: uuid.UUID | None = None,
    action: str | None = None,
    outcome: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> AuditFilter:
    """The search and export filter of these fields (InvalidInput: a bound has no UTC time)."""
    tenant = None if tenant_id is None else str(tenant_id)
    return AuditFilter(tenant, since, until, action, outcome)


def search(
    state: GatewayState,
    caller: AdminCaller,
    selection: AuditFilter,
    limit: int = 100,
    *,
    before_seq: int | None = None,
    after_seq: int | None = None,
) -> AuditEventPage:
    """One page of the events the caller may see that match `selection`: newest first, or
    oldest first after `after_seq`."""
    with state.store.transaction() as session:
        scoped = visible_filter(session, caller, selection)
        try:
            page = audit_search.search_events(
                session, scoped, limit, before_seq=before_seq, after_seq=after_seq
            )
        except TenancyError as error:
            raise from_tenancy_error(error) from error
        data = [event_out(row) for row in page.events]
    return AuditEventPage(data=data, next_cursor=page.next_cursor)


def visible_filter(session: Session, caller: AdminCaller, selection: AuditFilter) -> AuditFilter:
    """`selection` narrowed to what the caller may read: a tenant-admin's own tenant only.

    A tenant-admin naming another tenant gets the 404 of a tenant that does not exist.
    """
    if caller.is_admin:
        return selection
    assert caller.tenant_id is not None  # a tenant-admin always has its tenant
    wanted = caller.tenant_id if selection.tenant_id is None else uuid.UUID(selection.tenant_id)
    tenant = visible_tenant(session, caller, wanted)
    return dataclasses.replace(selection, tenant_id=str(tenant.id))


def event_out(row: AuditEvent) -> AuditEventOut:
    return AuditEventOut(
        seq=row.seq,
        event_id=row.event_id,
        time=row.time,
        actor_type=row.actor_type,
        actor_id=row.actor_id,
        tenant_id=row.tenant_id,
        action=row.action,
        resource_type=row.resource_type,
        resource_id=row.resource_id,
        outcome=row.outcome,
        request_id=row.request_id,
        source_ip=row.source_ip,
        details=row.details,
    )
