"""The append-only audit log: chained inserts, signed checkpoints, and a spool for outages.

Appends lock the chain's head row, so concurrent writers (threads, processes, replicas) agree
on one order. When the database cannot be reached, events go to a local append-only spool
file (fsynced) and are written, in order, when it returns. Every event carries a unique
`event_id`, so a crash between writing the database and clearing the spool never duplicates
an event on replay, and the spool is cleared only after the database committed, so nothing
is lost.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tenancy.audit_chain import AuditRecord, chain_hash, event_payload, sign
from tenancy.models import AuditCheckpoint, AuditEvent, AuditHead, utcnow

logger = logging.getLogger(__name__)


class AuditLog:
    """Records audit events; safe to call from many threads."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        spool_path: Path,
        signing_key: str,
        checkpoint_every: int = 100,
    ) -> None:
        self._sessions = sessions
        self.spool_path = Path(spool_path)
        self._signing_key = signing_key
        self._checkpoint_every = checkpoint_every
        self._lock = threading.Lock()

    def record(self, record: AuditRecord) -> bool:
        """Append one event; returns True if it reached the database, False if spooled."""
        return self.record_many([record])

    def record_many(self, records: list[AuditRecord]) -> bool:
        """Append events in order, in one transaction; False if they had to be spooled."""
        with self._lock, self._spool_locked():
            if self._spool_pending():
                for record in records:
                    self._append_to_spool(record)
                return self._flush_spool()
            try:
                self._insert(records)
                return True
            except (OperationalError, DBAPIError) as error:
                logger.warning("audit database unavailable, spooling: %s", error.__class__.__name__)
                for record in records:
                    self._append_to_spool(record)
                return False

    def flush(self) -> bool:
        """Write spooled events to the database; True when the spool is empty afterwards."""
        with self._lock, self._spool_locked():
            return self._flush_spool()

    def pending(self) -> int:
        """Events waiting in the spool."""
        with self._lock, self._spool_locked():
            return len(self._read_spool())

    # -- database ----------------------------------------------------------------------------

    def _insert(self, records: list[AuditRecord], replay: bool = False) -> None:
        """Chain and insert in one transaction (Core executemany: one round trip)."""
        with self._sessions.begin() as session:
            seq, digest = session.execute(
                select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1).with_for_update()
            ).one()
            if replay:  # from the spool: skip events a crash left already written
                known = set(
                    session.scalars(
                        select(AuditEvent.event_id).where(
                            AuditEvent.event_id.in_([r.event_id for r in records])
                        )
                    )
                )
                records = [record for record in records if record.event_id not in known]
            if not records:
                return
            rows, checkpoints = [], []
            for record in records:
                prev_hash, seq = digest, seq + 1
                digest = chain_hash(prev_hash, event_payload(record, seq))
                rows.append(_row(record, seq, prev_hash, digest))
                if seq % self._checkpoint_every == 0:
                    checkpoints.append(self._checkpoint(seq, digest))
            session.execute(insert(AuditEvent), rows)
            if checkpoints:
                session.execute(insert(AuditCheckpoint), checkpoints)
            session.execute(update(AuditHead).where(AuditHead.id == 1).values(seq=seq, hash=digest))

    def checkpoint_now(self) -> AuditCheckpoint | None:
        """Sign the current head (used before exports and on shutdown)."""
        with self._lock, self._sessions.begin() as session:
            head = session.get(AuditHead, 1)
            if head is None or head.seq == 0:
                return None
            if session.get(AuditCheckpoint, head.seq) is not None:
                return None
            checkpoint = AuditCheckpoint(**self._checkpoint(head.seq, head.hash))
            session.add(checkpoint)
            return checkpoint

    def _checkpoint(self, seq: int, digest: str) -> dict[str, Any]:
        signature = sign({"seq": seq, "hash": digest}, self._signing_key)
        return {"seq": seq, "hash": digest, "signature": signature, "created_at": utcnow()}

    # -- spool -------------------------------------------------------------------------------

    @contextmanager
    def _spool_locked(self) -> Iterator[None]:
        """Serialise processes sharing one spool file."""
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.spool_path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _spool_pending(self) -> bool:
        try:
            return self.spool_path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def _append_to_spool(self, record: AuditRecord) -> None:
        line = json.dumps(record.to_json(), ensure_ascii=False) + "\n"
        with open(self.spool_path, "a", encoding="utf-8") as spool:
            spool.write(line)
            spool.flush()
            os.fsync(spool.fileno())

    def _read_spool(self) -> list[AuditRecord]:
        try:
            lines = self.spool_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        records = []
        for number, line in enumerate(lines):
            try:
                records.append(AuditRecord.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                # Only a crash mid-write leaves a torn line, and only as the last one.
                if number != len(lines) - 1:
                    raise
                logger.error("dropping a torn last line of the audit spool")
        return records

    def _flush_spool(self) -> bool:
        records = self._read_spool()
        if not records:
            self._clear_spool()
            return True
        try:
            self._insert(records, replay=True)
        except (OperationalError, DBAPIError):
            return False
        self._clear_spool()
        return True

    def _clear_spool(self) -> None:
        with open(self.spool_path, "w") as spool:
            spool.flush()
            os.fsync(spool.fileno())


def _row(record: AuditRecord, seq: int, prev_hash: str, digest: str) -> dict[str, Any]:
    return {
        "seq": seq,
        "event_id": record.event_id,
        "time": record.time,
        "actor_type": record.actor_type,
        "actor_id": record.actor_id,
        "tenant_id": record.tenant_id,
        "action": record.action,
        "resource_type": record.resource_type,
        "resource_id": record.resource_id,
        "outcome": record.outcome,
        "request_id": record.request_id,
        "source_ip": record.source_ip,
        "details": record.details,
        "prev_hash": prev_hash,
        "hash": digest,
    }


def record_from_row(row: AuditEvent) -> AuditRecord:
    """The caller-level record of a stored event (for re-hashing during verification)."""
    return AuditRecord(
        actor_type=row.actor_type,
        action=row.action,
        outcome=row.outcome,
        actor_id=row.actor_id,
        tenant_id=row.tenant_id,
        resource_type=row.resource_type,
        resource_id=row.resource_id,
        request_id=row.request_id,
        source_ip=row.source_ip,
        details=row.details,
        event_id=row.event_id,
        time=row.time,
    )
