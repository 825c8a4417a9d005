"""Audit verification: of an export file, and of the chain stored in the database.

`verify_file` checks an export (tenancy/audit_export.py writes them) alone, against its signed
trailer: it names the first event that was modified (its hash no longer matches), deleted,
inserted or reordered (the signed list disagrees), and a cut-off tail (no valid trailer).
Input that is not an export at all raises `UnreadableAuditFile`, never a verdict of tampering.
`verify_database` checks the database's chain against its own checkpoints and those of the
external checkpoint file, which outlive any cut of the chain's tail inside the database.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tenancy import audit_files
from tenancy.audit_chain import (
    EVENT_FIELDS,
    GENESIS_HASH,
    chain_hash,
    event_payload,
    signature_valid,
)
from tenancy.audit_export import CSV_COLUMNS, CSV_NULL, FORMAT
from tenancy.audit_files import SignedCheckpoint, UnreadableAuditFile
from tenancy.audit_log import record_from_row
from tenancy.models import AuditCheckpoint, AuditEvent, AuditHead

_BATCH = 1000  # stored events read from the database at a time


@dataclass(frozen=True, slots=True)
class VerifyResult:
    ok: bool
    events: int
    problem: str | None = None


def verify_file(path: Path, signing_key: str) -> VerifyResult:
    """Check an export; names the first problem it finds.

    Raises UnreadableAuditFile when `path` is not an export at all (missing, not text, not
    our format); a result that is not ok always means the export was tampered with.
    """
    records = _read(path)
    events = [record for record in records if record["record"] == "event"]
    trailers = [record for record in records if record["record"] == "trailer"]
    trailer = trailers[-1] if trailers else None
    expected = None
    if trailer is not None:
        statement = {key: value for key, value in trailer.items() if key not in _UNSIGNED}
        # Only a signed list of sequence numbers is expanded (an unsigned one could be huge).
        if signature_valid(statement, trailer["signature"], signing_key):
            expected = _expand(trailer["seqs"])

    previous: dict[str, Any] | None = None
    for position, event in enumerate(events):
        seq = event["seq"]
        payload = {name: event.get(name) for name in EVENT_FIELDS}
        if chain_hash(event["prev_hash"], payload) != event["hash"]:
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
    if expected is None:
        return VerifyResult(False, len(events), "the trailer's signature is invalid")
    if len(events) < len(expected):
        missing = expected[len(events)]
        return VerifyResult(False, len(events), f"the export is truncated before seq={missing}")
    if _digest(event["hash"] for event in events) != trailer["digest"]:
        return VerifyResult(False, len(events), "event hashes differ from the signed digest")
    return VerifyResult(True, len(events))


def verify_database(
    session: Session, signing_key: str, checkpoint_path: Path | None = None
) -> VerifyResult:
    """Check the stored chain, the head row, and every signed checkpoint.

    The checkpoints are the database's and, when `checkpoint_path` is given, those kept in
    that file outside it: one the chain no longer reaches means its tail was cut. Raises
    UnreadableAuditFile if the checkpoint file cannot be read. Safe while events are being
    appended: the check covers the chain up to the head as it was when the check began (the
    head moves in the same transaction as the events it covers, so those are all there).
    """
    external = audit_files.read_checkpoints(checkpoint_path) if checkpoint_path else []
    stored = session.scalars(select(AuditCheckpoint).order_by(AuditCheckpoint.seq))
    checkpoints = [(SignedCheckpoint(row.seq, row.hash, row.signature), "") for row in stored]
    checkpoints += [(checkpoint, " in the file") for checkpoint in external]
    chain = _Chain(checkpoint_seqs={checkpoint.seq for checkpoint, _ in checkpoints})
    head = _head(session)  # after the checkpoints: none of them is past it
    problem = chain.follow(session, through=0 if head is None else head[0])
    if problem is not None:
        return VerifyResult(False, chain.count, problem)
    if head != (chain.seq, chain.hash):
        return VerifyResult(
            False, chain.count, f"the chain's tail after seq={chain.seq} is missing"
        )
    count, last_seq = chain.count, chain.seq
    for checkpoint, where in checkpoints:
        statement = {"seq": checkpoint.seq, "hash": checkpoint.hash}
        if not signature_valid(statement, checkpoint.signature, signing_key):
            return VerifyResult(False, count, f"checkpoint seq={checkpoint.seq}{where} is forged")
    attested = max((checkpoint.seq for checkpoint in external), default=0)
    if attested > last_seq:
        problem = f"the chain ends at seq={last_seq} but the checkpoint file attests seq={attested}"
        return VerifyResult(False, count, problem)
    for checkpoint, where in checkpoints:
        if chain.checkpoint_hashes.get(checkpoint.seq) != checkpoint.hash:
            problem = f"events up to checkpoint seq={checkpoint.seq}{where} are missing or changed"
            return VerifyResult(False, count, problem)
    return VerifyResult(True, count)


@dataclass(slots=True)
class _Chain:
    """How far a check of the stored chain got, and the hashes its checkpoints will need."""

    checkpoint_seqs: set[int]
    seq: int = 0
    hash: str = GENESIS_HASH
    count: int = 0
    checkpoint_hashes: dict[int, str] = field(default_factory=dict)

    def follow(self, session: Session, through: int) -> str | None:
        """Check the stored events up to seq `through`; the first problem, if any."""
        query = select(AuditEvent).where(AuditEvent.seq <= through).order_by(AuditEvent.seq)
        rows = session.scalars(query.execution_options(yield_per=_BATCH))
        try:
            for row in rows:
                self.count += 1
                if row.seq != self.seq + 1:
                    return f"event seq={self.seq + 1} was deleted"
                if row.prev_hash != self.hash:
                    return f"event seq={row.seq} does not follow its parent"
                expected = chain_hash(row.prev_hash, event_payload(record_from_row(row), row.seq))
                if expected != row.hash:
                    return f"event seq={row.seq} was modified"
                self.seq, self.hash = row.seq, row.hash
                if row.seq in self.checkpoint_seqs:
                    self.checkpoint_hashes[row.seq] = row.hash
        finally:
            rows.close()
        return None


def _head(session: Session) -> tuple[int, str] | None:
    """The head row as the database holds it now (never a copy the session remembers)."""
    head = session.execute(select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1)).first()
    return None if head is None else (head.seq, head.hash)


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


def _expand(ranges: list[list[int]]) -> list[int]:
    return [seq for first, last in ranges for seq in range(first, last + 1)]


def _digest(hashes: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for value in hashes:
        digest.update(value.encode())
    return digest.hexdigest()


_UNSIGNED = ("record", "signature")  # a trailer's fields outside its signed statement


def _read(path: Path) -> list[dict[str, Any]]:
    """The export's records, each checked for shape; raises UnreadableAuditFile otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UnreadableAuditFile(f"{path} is not a text file") from error
    except OSError as error:
        raise UnreadableAuditFile(f"cannot read {path}: {error.strerror}") from error
    if "\x00" in text:
        raise UnreadableAuditFile(f"{path} is not a text file")
    reader = _read_csv if text.startswith("record,") else _read_jsonl
    records = [_checked(record, where) for where, record in reader(text, path)]
    if not records or records[0]["record"] != "header" or records[0].get("format") != FORMAT:
        raise UnreadableAuditFile(f"{path} is not a PrefixGate audit export (no {FORMAT} header)")
    return records


def _read_jsonl(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {number}", json.loads(line)
        except ValueError as error:
            raise UnreadableAuditFile(f"{path} line {number} is not JSON") from error


def _read_csv(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    reader = csv.reader(io.StringIO(text))
    try:
        columns = next(reader)
        if tuple(columns) != CSV_COLUMNS:
            raise UnreadableAuditFile(f"{path}: the CSV columns are not {','.join(CSV_COLUMNS)}")
        for cells in reader:
            where = f"{path} line {reader.line_num}"
            if len(cells) != len(CSV_COLUMNS):
                raise UnreadableAuditFile(f"{where} has {len(cells)} cells, not {len(CSV_COLUMNS)}")
            yield where, _csv_record(dict(zip(CSV_COLUMNS, cells, strict=True)))
    except csv.Error as error:
        raise UnreadableAuditFile(f"{path} is not a readable CSV file: {error}") from error
    except ValueError as error:
        raise UnreadableAuditFile(f"{path} line {reader.line_num}: {error}") from error


def _csv_record(row: dict[str, str]) -> Any:
    kind = row["record"]
    if kind in ("header", "trailer"):
        # The header's and trailer's JSON ride in the last column.
        value = json.loads(row["hash"])
        return {"record": kind, **value} if isinstance(value, dict) else value
    event: dict[str, Any] = {"record": kind}
    for name in CSV_COLUMNS[1:]:
        value = None if row[name] == CSV_NULL else row[name]
        if name == "seq":
            value = int(row[name])
        elif name == "details" and value is not None:
            value = json.loads(value)
        event[name] = value
    return event


def _checked(record: Any, where: str) -> dict[str, Any]:
    """The record if it has the shape of a header, event or trailer (not its integrity)."""
    if not isinstance(record, dict):
        raise UnreadableAuditFile(f"{where} is not a JSON object")
    kind = record.get("record")
    if kind == "event" and not (
        _is_int(record.get("seq"))
        and isinstance(record.get("prev_hash"), str)
        and isinstance(record.get("hash"), str)
    ):
        raise UnreadableAuditFile(f"{where}: an event needs an integer seq and string hashes")
    if kind == "trailer" and not (
        isinstance(record.get("signature"), str)
        and isinstance(record.get("digest"), str)
        and isinstance(record.get("seqs"), list)
        and all(
            isinstance(pair, list) and len(pair) == 2 and all(_is_int(seq) for seq in pair)
            for pair in record["seqs"]
        )
    ):
        raise UnreadableAuditFile(f"{where}: a trailer needs a signature, digest and seqs")
    if kind not in ("header", "event", "trailer"):
        raise UnreadableAuditFile(f"{where} is not a header, event or trailer record")
    return record


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
