"""The audit log under /admin/api/audit: search, export download, and the chain's verification.

Search and export take the same filters (tenant, action or action prefix `tenant.*`, outcome,
since/until) and select through one `AuditFilter`, so a download holds exactly the events the
search pages through. A tenant-admin reads its own tenant's events only: its filter is forced
to its tenant, another tenant's id is the same 404 as a missing one, and events of no tenant
(logins, global changes) are never its.

A download is the signed export of `prefixgate audit export` (tenancy/audit_export.py writes
both), so `prefixgate audit verify` checks it. An export reads its whole selection, so what
one caller can make the database do with exports is bounded:

- at most a few are written at a time in the process, and one per holder (a tenant's
  administrators, or one operator), so no one caller takes every slot; past that the answer
  is at once a 429 `export_busy` (gateway/admin/export_slots.py; not audited: it read
  nothing, and a flood of refusals must not become a flood of audit writes);
- one COUNT of the selection refuses more than `MAX_EXPORT_EVENTS` events (an audited 400
  asking for a narrower range) before a byte is written;
- events are read a page per short transaction, up to the newest event at the start, so no
  read holds the database for the whole export (SQLite's writers wait for its readers);
- no checkpoint is signed for it: the export's trailer signs its own contents, and the audit
  writer signs the chain's head on its own schedule.

It is written in the route's worker thread to a spooled temporary file (in memory up to
`_SPOOL_BYTES`, then on disk) that the response streams and then closes.

Verifying the chain reads every event, so its status is cached per store for
`VERIFICATION_TTL_S` seconds, and callers arriving during a check wait for its result instead
of starting their own: at most one full read of the chain per interval, however many consoles
poll it. (An incremental check would miss an edit to an event it had already passed.)
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import IO, Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from gateway.admin.callers import AdminCaller, visible_tenant
from gateway.admin.export_slots import EXPORT_SLOTS, export_holder
from gateway.admin.schemas import IsoTime
from gateway.errors import from_tenancy_error
from gateway.http.deps import AdminDep, StateDep
from gateway.http.openapi import ADMIN_RESPONSES, error_response
from gateway.state import GatewayState
from tenancy import audit_search
from tenancy.audit_chain import AuditRecord
from tenancy.audit_export import ExportTooLarge, verify_database, write_export_in_pages
from tenancy.audit_files import UnreadableAuditFile
from tenancy.audit_search import AuditFilter
from tenancy.errors import TenancyError
from tenancy.models import AuditCheckpoint, AuditEvent
from tenancy.store import Store

router = APIRouter(prefix="/admin/api/audit", tags=["admin: audit"], responses=ADMIN_RESPONSES)

MAX_EXPORT_EVENTS = 100_000
VERIFICATION_TTL_S = 10.0
_SPOOL_BYTES = 8 << 20  # an export larger than this is spooled to disk, not kept in memory
_CHUNK_BYTES = 64 << 10
_MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


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


class VerificationOut(BaseModel):
    ok: bool
    events: int = Field(description="Events checked (up to the first problem)")
    problem: str | None
    last_checkpoint_seq: int | None
    last_checkpoint_time: datetime | None
    checked_at: datetime = Field(description=f"Results are reused for {VERIFICATION_TTL_S:g} s")


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
    tenant = None if tenant_id is None else str(tenant_id)
    return AuditFilter(tenant, since, until, action, outcome)


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
    return search(state, caller, selection, limit, before_seq=before_seq, after_seq=after_seq)


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The signed export, as a file to save",
            "content": {media_type: {} for media_type in _MEDIA_TYPES.values()},
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
    download = export(state, caller, selection, file_format)
    return StreamingResponse(
        _chunks(download.file),
        media_type=download.media_type,
        headers={
            "Content-Disposition": f'attachment; filename="{download.filename}"',
            "Content-Length": str(download.size),
        },
    )


@router.get("/verification")
def verification(caller: AdminDep, state: StateDep) -> VerificationOut:
    """Whether the stored hash chain and its signed checkpoints verify (admins only)."""
    return chain_status(state, caller)


# -- what the routes do (the console calls these too) ------------------------------------------


def search(
    state: GatewayState,
    caller: AdminCaller,
    selection: AuditFilter,
    limit: int = 100,
    *,
    before_seq: int | None = None,
    after_seq: int | None = None,
) -> AuditEventPage:
    """One page of the events the caller may see that match `selection` (blocking)."""
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


@dataclasses.dataclass(slots=True)
class AuditDownload:
    """A finished export: the file (at its start), what to call it, and its size."""

    file: IO[bytes]
    filename: str
    media_type: str
    size: int
    events: int


def export(
    state: GatewayState, caller: AdminCaller, selection: AuditFilter, file_format: str
) -> AuditDownload:
    """Write the signed export of the events the caller may see that match `selection`.

    Blocking (database, file): run it in a worker thread. A 429 at once when the export slots
    (or the caller's one) are taken; a 400 past MAX_EXPORT_EVENTS events. The export is
    audited, and so is the 400. The caller closes `file`.
    """
    with state.store.transaction() as session:
        scoped = visible_filter(session, caller, selection)
    with EXPORT_SLOTS.hold(export_holder(caller)):
        return _write_download(state, caller, scoped, file_format)


def _write_download(
    state: GatewayState, caller: AdminCaller, scoped: AuditFilter, file_format: str
) -> AuditDownload:
    """The export of `scoped` (already narrowed to what the caller may see) in a spooled file."""
    details: dict[str, Any] = {"format": file_format, **scoped.as_dict()}
    with state.store.transaction() as session:
        through_seq = audit_search.last_seq(session)
        selected = audit_search.count_events(session, scoped, through_seq)
    if selected > MAX_EXPORT_EVENTS:
        error = ExportTooLarge(MAX_EXPORT_EVENTS)
        _audit_export(state, caller, scoped, "failure", {**details, "error": str(error)})
        raise from_tenancy_error(error)
    # Not a `with`: the file outlives this call, the response streams it and closes it.
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)  # noqa: SIM115
    text = io.TextIOWrapper(spool, encoding="utf-8", newline="")
    try:
        count = write_export_in_pages(
            state.store.transaction,
            scoped,
            text,
            file_format,
            state.store.signing_key,
            through_seq,
        )
        text.flush()
        text.detach()
    except BaseException:
        text.close()
        raise
    size = spool.tell()
    spool.seek(0)
    _audit_export(state, caller, scoped, "success", {**details, "events": count})
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return AuditDownload(
        file=spool,
        filename=f"prefixgate-audit-{stamp}.{file_format}",
        media_type=_MEDIA_TYPES[file_format],
        size=size,
        events=count,
    )


def chain_status(state: GatewayState, caller: AdminCaller) -> VerificationOut:
    """The chain's verification status, at most VERIFICATION_TTL_S old (admins only; blocking)."""
    caller.require_admin()
    return _verifications.get(state.store, lambda: _verify(state))


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


def _chunks(file: IO[bytes]) -> Iterator[bytes]:
    """The file's content in chunks; closed at the end (or when the client goes away)."""
    try:
        while chunk := file.read(_CHUNK_BYTES):
            yield chunk
    finally:
        file.close()


def _audit_export(
    state: GatewayState,
    caller: AdminCaller,
    selection: AuditFilter,
    outcome: str,
    details: dict[str, Any],
) -> None:
    state.store.record(
        AuditRecord(
            actor_type=caller.actor_type,
            actor_id=caller.actor_id,
            tenant_id=selection.tenant_id,
            action="audit.export",
            resource_type="audit_log",
            outcome=outcome,
            source_ip=caller.source_ip,
            details={**details, "role": caller.role},
        )
    )


def _verify(state: GatewayState) -> VerificationOut:
    store = state.store
    with store.transaction() as session:
        try:
            result = verify_database(session, store.signing_key, store.audit.checkpoint_path)
            ok, events, problem = result.ok, result.events, result.problem
        except UnreadableAuditFile as error:
            ok, events, problem = False, 0, f"the chain was not checked: {error}"
        last = session.execute(
            select(AuditCheckpoint.seq, AuditCheckpoint.created_at)
            .order_by(AuditCheckpoint.seq.desc())
            .limit(1)
        ).first()
    return VerificationOut(
        ok=ok,
        events=events,
        problem=problem,
        last_checkpoint_seq=None if last is None else last.seq,
        last_checkpoint_time=None if last is None else last.created_at,
        checked_at=datetime.now(UTC),
    )


class _VerificationCache:
    """Each store's last verification, reused for `ttl_s` seconds; one check at a time."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        # id(store) -> (the store, weakly: ids are reused), when it was checked, the result
        self._entries: dict[int, tuple[weakref.ref[Store], float, VerificationOut]] = {}

    def get(self, store: Store, check: Callable[[], VerificationOut]) -> VerificationOut:
        # Holding the lock while checking makes concurrent callers share one check.
        with self._lock:
            entry = self._entries.get(id(store))
            if (
                entry is not None
                and entry[0]() is store
                and time.monotonic() - entry[1] < self._ttl_s
            ):
                return entry[2]
            result = check()
            self._entries = {
                key: kept for key, kept in self._entries.items() if kept[0]() is not None
            }
            self._entries[id(store)] = (weakref.ref(store), time.monotonic(), result)
            return result


_verifications = _VerificationCache(VERIFICATION_TTL_S)
