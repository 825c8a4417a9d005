"""Audit export (JSONL or CSV) and its verification.

An export is a header, the selected events in sequence order with their chain hashes, and a
signed trailer listing which sequence numbers it holds and a digest of their hashes. So
`verify` can name the first event that was modified (its hash no longer matches), deleted,
inserted or reordered (the signed list disagrees), and a cut-off tail (no valid trailer).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy.audit_chain import (
    EVENT_FIELDS,
    GENESIS_HASH,
    canonical_json,
    chain_hash,
    event_payload,
    format_time,
    sign,
    signature_valid,
)
from tenancy.audit_log import record_from_row
from tenancy.models import AuditCheckpoint, AuditEvent, AuditHead

FORMAT = "prefixgate-audit-v1"
CSV_COLUMNS = ("record", *EVENT_FIELDS, "prev_hash", "hash")


@dataclass(frozen=True, slots=True)
class ExportFilter:
    tenant_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {
            "tenant_id": self.tenant_id,
            "since": format_time(self.since) if self.since else None,
            "until": format_time(self.until) if self.until else None,
        }


@dataclass(frozen=True, slots=True)
class VerifyResult:
    ok: bool
    events: int
    problem: str | None = None


def export_events(
    session: Session, selection: ExportFilter, out: Path, file_format: str, signing_key: str
) -> int:
    """Write the selected events to `out`; returns how many."""
    query = select(AuditEvent).order_by(AuditEvent.seq)
    if selection.tenant_id is not None:
        query = query.where(AuditEvent.tenant_id == selection.tenant_id)
    if selection.since is not None:
        query = query.where(AuditEvent.time >= selection.since)
    if selection.until is not None:
        query = query.where(AuditEvent.time < selection.until)
    events = [_event_dict(row) for row in session.scalars(query)]
    header = {
        "format": FORMAT,
        "exported_at": format_time(datetime.now(UTC)),
        "filter": selection.as_dict(),
    }
    trailer: dict[str, Any] = {
        "count": len(events),
        "seqs": _ranges(event["seq"] for event in events),
        "digest": _digest(event["hash"] for event in events),
        "filter": selection.as_dict(),
    }
    trailer["signature"] = sign(trailer, signing_key)
    with open(out, "w", encoding="utf-8", newline="") as handle:
        if file_format == "jsonl":
            handle.write(json.dumps({"record": "header", **header}) + "\n")
            for event in events:
                handle.write(json.dumps({"record": "event", **event}, ensure_ascii=False) + "\n")
            handle.write(json.dumps({"record": "trailer", **trailer}) + "\n")
        elif file_format == "csv":
            writer = csv.writer(handle)
            writer.writerow(CSV_COLUMNS)
            writer.writerow(["header", *[""] * (len(CSV_COLUMNS) - 2), canonical_json(header)])
            for event in events:
                writer.writerow(["event", *[_csv_cell(event[name]) for name in CSV_COLUMNS[1:]]])
            writer.writerow(["trailer", *[""] * (len(CSV_COLUMNS) - 2), canonical_json(trailer)])
        else:
            raise ValueError(f"unknown export format {file_format!r}; use jsonl or csv")
    return len(events)


def verify_file(path: Path, signing_key: str) -> VerifyResult:
    """Check an export; names the first problem it finds."""
    try:
        records = list(_read(path))
    except (OSError, ValueError, KeyError) as error:
        return VerifyResult(False, 0, f"cannot read {path}: {error}")
    events = [record for record in records if record.get("record") == "event"]
    trailers = [record for record in records if record.get("record") == "trailer"]
    trailer = trailers[-1] if trailers else None
    expected = _expand(trailer["seqs"]) if trailer else None

    previous: dict[str, Any] | None = None
    for position, event in enumerate(events):
        seq = event.get("seq")
        payload = {name: event.get(name) for name in EVENT_FIELDS}
        if chain_hash(str(event.get("prev_hash")), payload) != event.get("hash"):
            return VerifyResult(False, len(events), f"event seq={seq} was modified")
        if expected is not None:
            problem = _position_problem(position, seq, expected, events)
            if problem:
                return VerifyResult(False, len(events), problem)
        if (
            previous is not None
            and seq == previous["seq"] + 1
            and event["prev_hash"] != previous["hash"]
        ):
            return VerifyResult(
                False, len(events), f"event seq={seq} does not follow seq={previous['seq']}"
            )
        previous = event
    if trailer is None:
        last = events[-1]["seq"] if events else "none"
        return VerifyResult(
            False, len(events), f"the export is truncated after seq={last}: no signed trailer"
        )
    statement = {key: value for key, value in trailer.items() if key not in ("record", "signature")}
    if not signature_valid(statement, str(trailer.get("signature")), signing_key):
        return VerifyResult(False, len(events), "the trailer's signature is invalid")
    if len(events) < len(expected or []):
        missing = (expected or [])[len(events)]
        return VerifyResult(False, len(events), f"the export is truncated before seq={missing}")
    if _digest(event["hash"] for event in events) != trailer["digest"]:
        return VerifyResult(False, len(events), "event hashes differ from the signed digest")
    return VerifyResult(True, len(events))


def verify_database(session: Session, signing_key: str) -> VerifyResult:
    """Check the stored chain, the head row and every signed checkpoint."""
    previous_hash, previous_seq, count = GENESIS_HASH, 0, 0
    hashes: dict[int, str] = {}
    for row in session.scalars(select(AuditEvent).order_by(AuditEvent.seq)):
        count += 1
        if row.seq != previous_seq + 1:
            return VerifyResult(False, count, f"event seq={previous_seq + 1} was deleted")
        if row.prev_hash != previous_hash:
            return VerifyResult(False, count, f"event seq={row.seq} does not follow its parent")
        expected = chain_hash(row.prev_hash, event_payload(record_from_row(row), row.seq))
        if expected != row.hash:
            return VerifyResult(False, count, f"event seq={row.seq} was modified")
        previous_hash, previous_seq = row.hash, row.seq
        hashes[row.seq] = row.hash
    head = session.get(AuditHead, 1)
    if head is None or head.seq != previous_seq or head.hash != previous_hash:
        return VerifyResult(False, count, f"the chain's tail after seq={previous_seq} is missing")
    for checkpoint in session.scalars(select(AuditCheckpoint).order_by(AuditCheckpoint.seq)):
        statement = {"seq": checkpoint.seq, "hash": checkpoint.hash}
        if not signature_valid(statement, checkpoint.signature, signing_key):
            return VerifyResult(False, count, f"checkpoint seq={checkpoint.seq} is forged")
        if hashes.get(checkpoint.seq) != checkpoint.hash:
            return VerifyResult(
                False, count, f"events up to checkpoint seq={checkpoint.seq} are missing or changed"
            )
    return VerifyResult(True, count)


def _position_problem(
    position: int, seq: Any, expected: list[int], events: list[dict[str, Any]]
) -> str | None:
    if position < len(expected) and expected[position] == seq:
        return None
    if seq not in expected or any(event.get("seq") == seq for event in events[:position]):
        return f"event seq={seq} was inserted"
    present = {event.get("seq") for event in events}
    for wanted in expected[: position + 1]:
        if wanted not in present:
            return f"event seq={wanted} was deleted"
    return f"event seq={seq} was reordered"


def _event_dict(row: AuditEvent) -> dict[str, Any]:
    event = event_payload(record_from_row(row), row.seq)
    event["prev_hash"] = row.prev_hash
    event["hash"] = row.hash
    return event


def _ranges(seqs: Iterable[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for seq in seqs:
        if ranges and ranges[-1][1] == seq - 1:
            ranges[-1][1] = seq
        else:
            ranges.append([seq, seq])
    return ranges


def _expand(ranges: list[list[int]]) -> list[int]:
    return [seq for first, last in ranges for seq in range(first, last + 1)]


def _digest(hashes: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for value in hashes:
        digest.update(value.encode())
    return digest.hexdigest()


_CSV_NULL = "\\N"  # tells None apart from an empty string, as PostgreSQL's COPY does


def _csv_cell(value: Any) -> str:
    if value is None:
        return _CSV_NULL
    if isinstance(value, dict):
        return canonical_json(value)
    return str(value)


def _read(path: Path) -> Iterator[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if text.startswith("record,"):
        yield from _read_csv(text)
        return
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _read_csv(text: str) -> Iterator[dict[str, Any]]:
    reader = csv.reader(io.StringIO(text))
    columns = next(reader)
    for cells in reader:
        row = dict(zip(columns, cells, strict=True))
        kind = row["record"]
        if kind in ("header", "trailer"):
            yield {"record": kind, **json.loads(row["hash"])}
            continue
        event: dict[str, Any] = {"record": "event"}
        for name in columns[1:]:
            value: Any = None if row[name] == _CSV_NULL else row[name]
            if name == "seq":
                value = int(row[name])
            elif name == "details" and value is not None:
                value = json.loads(value)
            event[name] = value
        yield event
