"""The audit log page: filters, pages of events, export downloads and the chain's status.

The filters are the admin API's (from `gateway.admin.service.audit_events`): tenant, action
or action prefix (`tenant.*`), outcome and a time range, read here from the page's GET form.
The times are plain text fields in UTC, not the browser's date pickers (which show the
browser's own locale and take no zone): a time is typed as the table writes it
(`2030-01-31 23:59:59 UTC`) or in ISO 8601, with or without a zone (without one it is UTC, as
the labels say), and the filter shows it back as the table would write it, in UTC. The table
pages newest first; the export buttons download the admin API's signed export of exactly the
filtered events (JSONL or CSV, `gateway.admin.service.audit_downloads`), which `prefixgate
audit verify` checks; the export is audited. A tenant-admin sees its own tenant's events
only, and an admin also sees whether the stored hash chain verifies.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response, StreamingResponse

from gateway.admin.callers import AdminCaller
from gateway.admin.schemas import TypedTime
from gateway.admin.service import audit_downloads, audit_events
from gateway.admin.service.audit_events import AuditEventPage
from gateway.admin.service.chain_status import chain_status
from gateway.console.pages import CallerDep, ConsoleRoute, FormErrors, render
from gateway.errors import APIError, validation_to_api_error
from gateway.http.deps import StateDep
from gateway.state import GatewayState
from tenancy import tenants
from tenancy.audit_search import AuditFilter

router = APIRouter(prefix="/admin", route_class=ConsoleRoute, include_in_schema=False)

PAGE_SIZE = 50
FILTER_FIELDS = {"tenant", "action", "outcome", "since", "until"}
OUTCOMES = ("success", "failure", "rejected", "cancelled")
# The time fields' attributes: text (a date picker would show the browser's locale), no
# spelling marks, no suggestions.
UTC_FIELD = {
    "maxlength": "40",
    "placeholder": "YYYY-MM-DD hh:mm:ss UTC",
    "spellcheck": "false",
    "autocomplete": "off",
}


class AuditQuery(BaseModel):
    """The page's filter form, as the browser sends it (empty fields are absent)."""

    model_config = ConfigDict(extra="ignore")

    tenant: uuid.UUID | None = None
    action: Annotated[str, Field(max_length=100)] | None = None
    outcome: Annotated[str, Field(max_length=32)] | None = None
    since: TypedTime | None = None
    until: TypedTime | None = None

    def selection(self) -> AuditFilter:
        """The admin API's filter for these fields."""
        return audit_events.audit_selection(
            tenant_id=self.tenant,
            action=self.action,
            outcome=self.outcome,
            since=self.since,
            until=self.until,
        )


@router.get("/audit")
def audit_page(
    request: Request,
    caller: CallerDep,
    state: StateDep,
    before_seq: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
) -> Response:
    """A page of events matching the filters, newest first, with export buttons."""
    filled = _filled(request)
    try:
        query = _query(filled)
    except APIError as error:
        errors = FormErrors.of(error, {}, FILTER_FIELDS)
        return _render(request, caller, state, filled, errors, None, None, error.status)
    for name in ("since", "until"):  # shown back in UTC, as the table writes times
        moment = getattr(query, name)
        if moment is not None:
            filled[name] = utc_text(moment)
    selection = query.selection()
    page = audit_events.search(state, caller, selection, PAGE_SIZE, before_seq=before_seq)
    return _render(request, caller, state, filled, FormErrors(), page, before_seq)


@router.get("/audit/export")
def export_audit(
    request: Request,
    caller: CallerDep,
    state: StateDep,
    file_format: Annotated[Literal["jsonl", "csv"], Query(alias="format")] = "jsonl",
) -> Response:
    """Download the signed export of exactly the filtered events (the admin API's download)."""
    selection = _query(_filled(request)).selection()
    download = audit_downloads.export(state, caller, selection, file_format)
    return StreamingResponse(
        download.chunks(), media_type=download.media_type, headers=download.headers
    )


def utc_text(moment: datetime) -> str:
    """A time as the console writes it ("2030-01-31 23:59:59 UTC"), its fraction kept."""
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ") + " UTC"


def _filled(request: Request) -> dict[str, str]:
    """The filter fields the browser sent, as typed."""
    params = request.query_params
    return {name: params.get(name, "").strip() for name in FILTER_FIELDS}


def _query(filled: dict[str, str]) -> AuditQuery:
    """The filters, or the API's 400 naming the field that is wrong."""
    try:
        return AuditQuery.model_validate({k: v for k, v in filled.items() if v})
    except ValidationError as error:
        raise validation_to_api_error(error.errors()) from error


def _render(
    request: Request,
    caller: AdminCaller,
    state: GatewayState,
    filled: dict[str, str],
    errors: FormErrors,
    page: AuditEventPage | None,
    before_seq: int | None,
    status: int = 200,
) -> Response:
    with state.store.transaction() as session:
        rows = tenants.list_tenants(session, include_deleted=True)
        slugs = {str(tenant.id): tenant.slug for tenant in rows if caller.sees(tenant.id)}
        choices = [(str(t.id), t.slug) for t in rows if t.status != "deleted" and caller.sees(t.id)]
    filters = {name: value for name, value in filled.items() if value}
    return render(
        request,
        "audit.html",
        status,
        title="Audit log",
        filled=filled,
        filters=filters,
        errors=errors,
        page=page,
        before_seq=before_seq,
        slugs=slugs,
        tenant_choices=choices,
        outcome_choices=[("", "Any"), *((outcome, outcome) for outcome in OUTCOMES)],
        utc_field=UTC_FIELD,
        verification=chain_status(state, caller) if caller.is_admin else None,
    )
