"""The audit log under /admin/api/audit: search, export download, and the chain's verification.

Search and export take the same filters, read here from the query string; a tenant-admin reads
its own tenant's events only (gateway/admin/service/audit_events.py). A download is the signed
export `prefixgate audit verify` checks, bounded in how many are written at once and in size
(gateway/admin/service/audit_downloads.py); the chain's status is cached
(gateway/admin/service/chain_status.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from gateway.admin.deps import AdminDep
from gateway.admin.schemas import IsoTime
from gateway.admin.service import audit_downloads, audit_events
from gateway.admin.service.audit_downloads import MEDIA_TYPES
from gateway.admin.service.audit_events import AuditEventPage
from gateway.admin.service.chain_status import VerificationOut, chain_status
from gateway.http.deps import StateDep
from gateway.http.openapi import ADMIN_RESPONSES, error_response
from tenancy import audit_search
from tenancy.audit_search import AuditFilter

router = APIRouter(prefix="/admin/api/audit", tags=["admin: audit"], responses=ADMIN_RESPONSES)


def audit_filter(
    tenant_id: Annotated[uuid.UUID | None, Query(description="Only this tenant's events")] = None,
    action: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=100,
            description="An action (tenant.update), or a prefix ending in . or * (tenant.*)",
        ),
    ] = None,
    outcome: Annotated[
        str | None, Query(min_length=1, max_length=32, description="success, failure, ...")
    ] = None,
    since: Annotated[
        IsoTime | None, Query(description="From this time (inclusive; with a time zone)")
    ] = None,
    until: Annotated[
        IsoTime | None, Query(description="Before this time (with a time zone)")
    ] = None,
) -> AuditFilter:
    """The search and export filters, from the query string."""
    return audit_events.audit_selection(
        tenant_id=tenant_id, action=action, outcome=outcome, since=since, until=until
    )


FilterDep = Annotated[AuditFilter, Depends(audit_filter)]


@router.get("/events")
def search_events(
    caller: AdminDep,
    state: StateDep,
    selection: FilterDep,
    before_seq: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
    after_seq: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=audit_search.MAX_PAGE)] = 100,
) -> AuditEventPage:
    """Audit events that match every filter given: newest first, or oldest first after_seq."""
    return audit_events.search(
        state, caller, selection, limit, before_seq=before_seq, after_seq=after_seq
    )


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The signed export, as a file to save",
            "content": {media_type: {} for media_type in MEDIA_TYPES.values()},
        },
        429: error_response("Too many exports being written (export_busy); see Retry-After"),
    },
)
def export_audit(
    caller: AdminDep,
    state: StateDep,
    selection: FilterDep,
    file_format: Annotated[Literal["jsonl", "csv"], Query(alias="format")] = "jsonl",
) -> StreamingResponse:
    """Download the events the filters select in the signed format `prefixgate audit verify`
    checks (at most 100,000 events; the export is audited).

    At most two exports are written at a time, one per caller (a tenant's administrators
    count as one): past that the answer is a 429 `export_busy` with Retry-After."""
    download = audit_downloads.export(state, caller, selection, file_format)
    return StreamingResponse(
        download.chunks(), media_type=download.media_type, headers=download.headers
    )


@router.get("/verification")
def verification(caller: AdminDep, state: StateDep) -> VerificationOut:
    """Whether the stored hash chain and its signed checkpoints verify (admins only)."""
    return chain_status(state, caller)
