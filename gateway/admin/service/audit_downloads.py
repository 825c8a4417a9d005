"""Audit downloads: the signed export of the events an admin may see, bounded in what it costs.

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

It is written in the caller's worker thread to a spooled temporary file (in memory up to
`_SPOOL_BYTES`, then on disk) that the answer streams (`AuditDownload.chunks`) and then closes.
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any

from gateway.admin.callers import AdminCaller
from gateway.admin.export_slots import EXPORT_SLOTS, export_holder
from gateway.admin.service.audit_events import visible_filter
from gateway.errors import from_tenancy_error
from gateway.state import GatewayState
from tenancy import audit_search
from tenancy.audit_chain import AuditRecord
from tenancy.audit_export import ExportTooLarge, write_export_in_pages
from tenancy.audit_search import AuditFilter

MAX_EXPORT_EVENTS = 100_000
MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}
_SPOOL_BYTES = 8 << 20  # an export larger than this is spooled to disk, not kept in memory
_CHUNK_BYTES = 64 << 10


@dataclasses.dataclass(slots=True)
class AuditDownload:
    """A finished export: the file (at its start), what to call it, and its size."""

    file: IO[bytes]
    filename: str
    media_type: str
    size: int
    events: int

    @property
    def headers(self) -> dict[str, str]:
        """The answer's headers that offer it as a file to save."""
        return {
            "Content-Disposition": f'attachment; filename="{self.filename}"',
            "Content-Length": str(self.size),
        }

    def chunks(self) -> Iterator[bytes]:
        """The file's content in chunks; closed at the end (or when the client goes away)."""
        try:
            while chunk := self.file.read(_CHUNK_BYTES):
                yield chunk
        finally:
            self.file.close()


def export(
    state: GatewayState, caller: AdminCaller, selection: AuditFilter, file_format: str
) -> AuditDownload:
    """Write the signed export of the events the caller may see that match `selection`.

    A 429 at once when the export slots (or the caller's one) are taken; a 400 past
    MAX_EXPORT_EVENTS events. The export is audited, and so is the 400. The caller closes
    the download's file (reading `chunks` to the end does).
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
    # Not a `with`: the file outlives this call, the answer streams it and closes it.
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
        media_type=MEDIA_TYPES[file_format],
        size=size,
        events=count,
    )


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
