"""Audit export: the signed JSONL or CSV file of selected events, and its one writer.

An export is a header, the selected events in sequence order with their chain hashes, and a
signed trailer listing which sequence numbers it holds and a digest of their hashes. So a
verifier (tenancy/audit_verification.py) can name the first event that was modified (its hash
no longer matches), deleted, inserted or reordered (the signed list disagrees), and a cut-off
tail (no valid trailer).

`write_export` is the format's one home: the CLI writes it to a file (`export_events`), the
admin API to a download. Both stream events from the database in batches, so memory does not
grow with the export; the API caps how many events one export may hold (`ExportTooLarge`).
The API reads with `write_export_in_pages`: each batch in a transaction of its own, so no read
holds the database for the whole export (SQLite's writers wait for its readers), and only
events up to a sequence number fixed beforehand, so the pages add up to one snapshot.

An export needs no fresh checkpoint of the database's chain: its trailer signs the list of
sequence numbers and the digest of their hashes itself, so `verify_file` checks it alone.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy.audit_chain import (
    EVENT_FIELDS,
    canonical_json,
    event_payload,
    format_time,
    sign,
)
from tenancy.audit_log import record_from_row
from tenancy.audit_search import AuditFilter
from tenancy.errors import InvalidInput
from tenancy.models import AuditEvent
from tenancy.private_paths import PRIVATE_FILE

FORMAT = "prefixgate-audit-v1"
FORMATS = ("jsonl", "csv")
CSV_COLUMNS = ("record", *EVENT_FIELDS, "prev_hash", "hash")
CSV_NULL = "\\N"  # tells None apart from an empty string, as PostgreSQL's COPY does
_BATCH = 1000  # events read from the database at a time

# The filter an export was made with: the search's filter, so both select the same events.
ExportFilter = AuditFilter


class ExportTooLarge(InvalidInput):
    """The filter selects more events than one export may hold."""

    def __init__(self, max_events: int) -> None:
        super().__init__(
            f"the filter selects more than {max_events} events, the most one export holds; "
            "ask for a narrower time range (since/until) or filter by tenant, action or outcome"
        )
        self.max_events = max_events


def export_events(
    session: Session, selection: AuditFilter, out: Path, file_format: str, signing_key: str
) -> int:
    """Write the selected events to `out` (a new file mode 0600, like the audit files it
    comes from); returns how many."""
    _check_format(file_format)
    with open(out, "w", encoding="utf-8", newline="", opener=_private) as handle:
        return write_export(session, selection, handle, file_format, signing_key)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, PRIVATE_FILE)


def write_export(
    session: Session,
    selection: AuditFilter,
    handle: TextIO,
    file_format: str,
    signing_key: str,
    max_events: int | None = None,
) -> int:
    """Write the export of the selected events to a text stream; returns how many.

    Open files with `newline=""` (CSV writes its own line ends). Raises ValueError for an
    unknown format and, past `max_events` events, ExportTooLarge: what was written by then is
    not an export (it has no trailer) and belongs in the bin.
    """
    _check_format(file_format)
    query = selection.where(select(AuditEvent)).order_by(AuditEvent.seq)
    rows = session.scalars(query.execution_options(yield_per=_BATCH))
    try:
        events = (_event_dict(row) for row in rows)
        return _write(events, selection, handle, file_format, signing_key, max_events)
    finally:
        rows.close()


def write_export_in_pages(
    transaction: Callable[[], AbstractContextManager[Session]],
    selection: AuditFilter,
    handle: TextIO,
    file_format: str,
    signing_key: str,
    through_seq: int,
) -> int:
    """Write the export of the selected events up to sequence number `through_seq`, reading
    each batch in a short transaction of its own (`transaction()` opens one); returns how many.

    It has no cap of its own: count the events first (`audit_search.count_events` with the
    same `through_seq`) and refuse a large export before calling it.
    """
    _check_format(file_format)
    return _write(
        _paged_events(transaction, selection, through_seq),
        selection,
        handle,
        file_format,
        signing_key,
    )


def _paged_events(
    transaction: Callable[[], AbstractContextManager[Session]],
    selection: AuditFilter,
    through_seq: int,
) -> Iterator[dict[str, Any]]:
    """The selected events up to `through_seq` in order, a transaction per batch (keyset)."""
    after_seq = 0
    while True:
        query = (
            selection.where(select(AuditEvent))
            .where(AuditEvent.seq > after_seq, AuditEvent.seq <= through_seq)
            .order_by(AuditEvent.seq)
            .limit(_BATCH)
        )
        with transaction() as session:
            events = [_event_dict(row) for row in session.scalars(query)]
        yield from events
        if len(events) < _BATCH:
            return
        after_seq = events[-1]["seq"]


def _write(
    events: Iterable[dict[str, Any]],
    selection: AuditFilter,
    handle: TextIO,
    file_format: str,
    signing_key: str,
    max_events: int | None = None,
) -> int:
    """Header, `events` (past `max_events`: ExportTooLarge), signed trailer; returns how many."""
    write = _record_writer(handle, file_format)
    write(
        "header",
        {
            "format": FORMAT,
            "exported_at": format_time(datetime.now(UTC)),
            "filter": selection.as_dict(),
        },
    )
    count, seqs, digest = 0, _SeqRanges(), hashlib.sha256()
    for event in events:
        count += 1
        if max_events is not None and count > max_events:
            raise ExportTooLarge(max_events)
        seqs.add(event["seq"])
        digest.update(event["hash"].encode())
        write("event", event)
    trailer: dict[str, Any] = {
        "count": count,
        "seqs": seqs.ranges,
        "digest": digest.hexdigest(),
        "filter": selection.as_dict(),
    }
    trailer["signature"] = sign(trailer, signing_key)
    write("trailer", trailer)
    return count


def _check_format(file_format: str) -> None:
    if file_format not in FORMATS:
        raise ValueError(f"unknown export format {file_format!r}; use jsonl or csv")


def _record_writer(handle: TextIO, file_format: str) -> Callable[[str, dict[str, Any]], None]:
    """A function that writes one record (header, event or trailer) in the export's format."""
    if file_format == "jsonl":

        def write_jsonl(kind: str, value: dict[str, Any]) -> None:
            # Events keep their text as is; the header and trailer are plain ASCII JSON.
            line = json.dumps({"record": kind, **value}, ensure_ascii=kind != "event")
            handle.write(line + "\n")

        return write_jsonl
    writer = csv.writer(handle)
    writer.writerow(CSV_COLUMNS)

    def write_csv(kind: str, value: dict[str, Any]) -> None:
        if kind == "event":
            writer.writerow(["event", *[_csv_cell(value[name]) for name in CSV_COLUMNS[1:]]])
        else:  # the header's and trailer's JSON ride in the last column
            writer.writerow([kind, *[""] * (len(CSV_COLUMNS) - 2), canonical_json(value)])

    return write_csv


def _event_dict(row: AuditEvent) -> dict[str, Any]:
    event = event_payload(record_from_row(row), row.seq)
    event["prev_hash"] = row.prev_hash
    event["hash"] = row.hash
    return event


class _SeqRanges:
    """Sequence numbers as runs `[first, last]`, built one number at a time."""

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []

    def add(self, seq: int) -> None:
        if self.ranges and self.ranges[-1][1] == seq - 1:
            self.ranges[-1][1] = seq
        else:
            self.ranges.append([seq, seq])


def _csv_cell(value: Any) -> str:
    if value is None:
        return CSV_NULL
    if isinstance(value, dict):
        return canonical_json(value)
    return str(value)
