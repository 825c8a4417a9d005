"""The append-only audit log: chained inserts, signed checkpoints, a spool and dead letters.

Appends lock the chain's head row, so concurrent writers (threads, processes, replicas) agree
on one order. Every record is first fitted to its columns (`bounded`). Then a failure is one
of two kinds, told apart in one place (`tenancy.db.is_outage`):

- the database cannot be reached: events go to a local append-only spool file (fsynced) and
  are written, in order, when it returns. Every event carries a unique `event_id` and events
  already stored are skipped, so a crash between writing the database and clearing the spool
  never duplicates an event, and the spool is cleared only after the database committed.
- the database refuses the data: the batch is retried one event at a time, and only the
  event still refused goes to the dead-letter file, with a log line; it never blocks the
  events after it, and since its transaction rolled back the chain never saw it. After a
  fix, `resubmit` appends such events (tenancy/audit_replay.py), each once by its id.

Signed checkpoints go to the database and, after it committed, to an append-only checkpoint
file outside it, so cutting the chain's tail in the database cannot go unnoticed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from tenancy import audit_files
from tenancy.audit_bounds import bounded
from tenancy.audit_chain import (
    RECORD_FIELDS,
    AuditRecord,
    chain_hash,
    event_payload,
    format_time,
    sign,
)
from tenancy.audit_files import SignedCheckpoint
from tenancy.db import is_outage
from tenancy.models import AuditCheckpoint, AuditEvent, AuditHead, utcnow

logger = logging.getLogger(__name__)
# Events per transaction when writing a spool (bounds the statement's parameters).
BATCH_EVENTS = 500


@dataclass(slots=True)
class Delivery:
    """What became of events handed to the database, each in exactly one list."""

    written: list[AuditRecord] = field(default_factory=list)
    already_stored: list[AuditRecord] = field(default_factory=list)  # skipped: stored before
    refused: list[tuple[AuditRecord, str]] = field(default_factory=list)  # alone, with why
    unwritten: list[AuditRecord] = field(default_factory=list)  # from the first unreachable one
    outage: str | None = None  # why the database was unreachable, if it was

    def note_inserted(self, records: list[AuditRecord], stored_before: set[uuid.UUID]) -> None:
        for record in records:
            stored = self.already_stored if record.event_id in stored_before else self.written
            stored.append(record)


class AuditLog:
    """Records audit events; safe to call from many threads."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        spool_path: Path,
        signing_key: str,
        checkpoint_every: int = 100,
        *,
        checkpoint_path: Path | None = None,
    ) -> None:
        self._sessions = sessions
        self.spool_path = Path(spool_path)
        self.dead_letter_path = self.spool_path.with_suffix(".dead-letters.jsonl")
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        self._signing_key = signing_key
        self._checkpoint_every = checkpoint_every
        self._lock = threading.Lock()
        self._dead_letter_count: tuple[tuple[int, int], int] | None = None

    def record(self, record: AuditRecord) -> bool:
        """Append one event; returns True if it reached the database, False if spooled."""
        return self.record_many([record])

    def record_many(self, records: list[AuditRecord]) -> bool:
        """Append events in order; False if any had to be spooled (the database is away).

        An event the database refuses is dead-lettered and counts as handled.
        """
        records = [bounded(record) for record in records]
        with self._lock, audit_files.locked(self.spool_path):
            if self._spool_pending():  # keep the order: queue behind the spooled events
                self._append_to_spool(records)
                return self._flush_spool()
            unwritten = self._deliver(records)
            self._append_to_spool(unwritten)
            return not unwritten

    def flush(self) -> bool:
        """Write spooled events to the database; True when the spool is empty afterwards."""
        with self._lock, audit_files.locked(self.spool_path):
            return self._flush_spool()

    def pending(self) -> int:
        """Events waiting in the spool."""
        with self._lock, audit_files.locked(self.spool_path):
            return audit_files.count_lines(self.spool_path)

    def resubmit(self, records: list[AuditRecord]) -> Delivery:
        """Append events set aside earlier (dead letters) after a fix; one transaction a batch.

        Nothing is dead-lettered or spooled here: the caller keeps what is still refused or
        unwritten. An event whose id is already stored is skipped, so this is idempotent.
        """
        return self._attempt([bounded(record) for record in records])

    def dead_letters(self) -> int:
        """Events the database refused, kept in `dead_letter_path` (by any process)."""
        try:
            stat = self.dead_letter_path.stat()
        except FileNotFoundError:
            return 0
        version = (stat.st_size, stat.st_mtime_ns)
        if self._dead_letter_count is None or self._dead_letter_count[0] != version:
            self._dead_letter_count = (version, audit_files.count_lines(self.dead_letter_path))
        return self._dead_letter_count[1]

    # -- database ----------------------------------------------------------------------------

    def _deliver(self, records: list[AuditRecord]) -> list[AuditRecord]:
        """Write what the database accepts, dead-letter what it refuses; returns the rest.

        The rest is what could not be written because the database is unreachable (in
        order, from the first such event), to be spooled. A long outage's spool is written
        in chunks, each a transaction of bounded size.
        """
        for start in range(0, len(records), BATCH_EVENTS):
            unwritten = self._deliver_chunk(records[start : start + BATCH_EVENTS])
            if unwritten:
                return unwritten + records[start + BATCH_EVENTS :]
        return []

    def _deliver_chunk(self, records: list[AuditRecord]) -> list[AuditRecord]:
        delivery = self._attempt(records)
        for record, reason in delivery.refused:
            self._dead_letter(record.to_json(), reason)
        if delivery.outage is not None:
            logger.warning("audit database unavailable, spooling: %s", delivery.outage)
        return delivery.unwritten

    def _attempt(self, records: list[AuditRecord]) -> Delivery:
        """Insert in one transaction; if the database refuses that, one event at a time.

        Only an event refused alone counts as refused. Once the database is unreachable,
        that event and the ones after it are left unwritten, in order.
        """
        delivery = Delivery()
        try:
            delivery.note_inserted(records, self._insert(records))
            return delivery
        except Exception as error:
            if is_outage(error):
                delivery.unwritten, delivery.outage = records, _describe(error)
                return delivery
        for position, record in enumerate(records):
            try:
                delivery.note_inserted([record], self._insert([record]))
            except Exception as error:
                if is_outage(error):
                    delivery.unwritten, delivery.outage = records[position:], _describe(error)
                    return delivery
                delivery.refused.append((record, _describe(error)))
        return delivery

    def _insert(self, records: list[AuditRecord]) -> set[uuid.UUID]:
        """Chain and insert in one transaction (Core executemany: one round trip).

        Events already stored (a replay after a crash) are skipped, so writing is idempotent;
        returns their ids. No event is ever stored twice: `event_id` is unique, and on
        PostgreSQL the check runs under the head's row lock, so concurrent writers skip an
        event another one stored rather than collide on it.
        """
        checkpoints: list[SignedCheckpoint] = []
        with self._sessions.begin() as session:
            seq, digest = session.execute(
                select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1).with_for_update()
            ).one()
            known = set(
                session.scalars(
                    select(AuditEvent.event_id).where(
                        AuditEvent.event_id.in_([r.event_id for r in records])
                    )
                )
            )
            records = [record for record in records if record.event_id not in known]
            if not records:
                return known
            rows = []
            for record in records:
                prev_hash, seq = digest, seq + 1
                digest = chain_hash(prev_hash, event_payload(record, seq))
                rows.append(_row(record, seq, prev_hash, digest))
                if seq % self._checkpoint_every == 0:
                    checkpoints.append(self._sign(seq, digest))
            session.execute(insert(AuditEvent), rows)
            if checkpoints:
                session.execute(insert(AuditCheckpoint), [_checkpoint_row(c) for c in checkpoints])
            session.execute(update(AuditHead).where(AuditHead.id == 1).values(seq=seq, hash=digest))
        self._keep_outside(checkpoints)
        return known

    def checkpoint_now(self) -> AuditCheckpoint | None:
        """Sign the current head (before exports, periodically, on shutdown); None if no events.

        The head is also written to the checkpoint file when the database already had it
        signed, so the file always attests the newest head this process has seen.
        """
        with self._lock:
            with self._sessions.begin() as session:
                head = session.execute(
                    select(AuditHead).where(AuditHead.id == 1).with_for_update()
                ).scalar_one_or_none()
                if head is None or head.seq == 0:
                    return None
                checkpoint = self._sign(head.seq, head.hash)
                created = None
                if session.get(AuditCheckpoint, head.seq) is None:
                    created = AuditCheckpoint(**_checkpoint_row(checkpoint))
                    session.add(created)
            self._keep_outside([checkpoint])
            return created

    def _sign(self, seq: int, digest: str) -> SignedCheckpoint:
        return SignedCheckpoint(seq, digest, sign({"seq": seq, "hash": digest}, self._signing_key))

    def _keep_outside(self, checkpoints: list[SignedCheckpoint]) -> None:
        """After the database committed them, append checkpoints to the external file."""
        if self.checkpoint_path is None:
            return
        for checkpoint in checkpoints:
            audit_files.append_checkpoint(self.checkpoint_path, checkpoint)

    # -- spool and dead letters --------------------------------------------------------------

    def _spool_pending(self) -> bool:
        try:
            return self.spool_path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def _append_to_spool(self, records: list[AuditRecord]) -> None:
        audit_files.append_lines(self.spool_path, _spool_lines(records))

    def _read_spool(self) -> list[AuditRecord]:
        """Spooled records; a line that is not one (torn by a crash, corrupt) is dead-lettered."""
        spooled = audit_files.read_lines(self.spool_path)
        records = []
        for line in spooled.bad_lines:
            self._dead_letter({"unparsed_spool_line": line}, "ValueError: not a spooled event")
        for value in spooled.objects:
            try:
                records.append(bounded(AuditRecord.from_json(value)))
            except (ValueError, KeyError, TypeError) as error:
                self._dead_letter({"unparsed_spool_line": value}, _describe(error))
        return records

    def _flush_spool(self) -> bool:
        records = self._read_spool()
        unwritten = self._deliver(records) if records else []
        if unwritten:
            # Keep only what is still unwritten, so nothing is dead-lettered twice.
            audit_files.replace_lines(self.spool_path, _spool_lines(unwritten))
            return False
        audit_files.replace_lines(self.spool_path, [])
        return True

    def _dead_letter(self, event: dict[str, Any], reason: str) -> None:
        """Keep an event the database refused, so it is out of the way but not lost.

        Under the file's lock: a replay rewriting the file meanwhile must not lose this line.
        """
        line = dead_letter_line(event, reason)
        with audit_files.locked(self.dead_letter_path):
            audit_files.append_lines(self.dead_letter_path, [audit_files.dumps(line)])
        logger.error(
            "audit event %s refused by the database (%s); kept in %s",
            event.get("event_id", "?"),
            reason,
            self.dead_letter_path,
        )


def dead_letter_line(event: dict[str, Any], reason: str) -> dict[str, Any]:
    """A line of the dead-letter file: when and why the database refused `event`."""
    return {"rejected_at": format_time(datetime.now(UTC)), "error": reason, "event": event}


def _describe(error: BaseException) -> str:
    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    message = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {message[0] if message else ''}"[:500]


def _spool_lines(records: list[AuditRecord]) -> list[str]:
    return [audit_files.dumps(record.to_json()) for record in records]


def _checkpoint_row(checkpoint: SignedCheckpoint) -> dict[str, Any]:
    return {**checkpoint.to_json(), "created_at": utcnow()}


def _row(record: AuditRecord, seq: int, prev_hash: str, digest: str) -> dict[str, Any]:
    return {"seq": seq, **record.field_values(), "prev_hash": prev_hash, "hash": digest}


def record_from_row(row: AuditEvent) -> AuditRecord:
    """The caller-level record of a stored event (for re-hashing during verification)."""
    return AuditRecord(**{name: getattr(row, name) for name in RECORD_FIELDS})
