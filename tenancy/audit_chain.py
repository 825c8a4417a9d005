"""The audit hash chain: canonical event encoding, chain hashes, signed statements.

`hash = SHA-256(prev_hash || canonical JSON of the event)`, where the canonical JSON has sorted
keys, no whitespace, UTF-8, and times as UTC ISO-8601 with microseconds. The event's sequence
number is part of what is hashed, so moving an event changes its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

GENESIS_HASH = "0" * 64


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """An event as the caller describes it; the log gives it a sequence number and hashes.

    Fields are declared in the order of an event's columns (in the database and in exports);
    the three every caller names, `actor_type`, `action` and `outcome`, may be positional.
    """

    event_id: uuid.UUID = field(default_factory=uuid.uuid4, kw_only=True)
    time: datetime = field(default_factory=_now, kw_only=True)
    actor_type: str
    actor_id: str | None = field(default=None, kw_only=True)
    tenant_id: str | None = field(default=None, kw_only=True)
    action: str
    resource_type: str | None = field(default=None, kw_only=True)
    resource_id: str | None = field(default=None, kw_only=True)
    outcome: str
    request_id: str | None = field(default=None, kw_only=True)
    source_ip: str | None = field(default=None, kw_only=True)
    details: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def field_values(self) -> dict[str, Any]:
        """Every field by name, as the database stores it."""
        return {name: getattr(self, name) for name in RECORD_FIELDS}

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (for the spool file)."""
        values = self.field_values()
        values["event_id"] = str(self.event_id)
        values["time"] = format_time(self.time)
        return values

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AuditRecord:
        values = dict(data)
        values["event_id"] = uuid.UUID(values["event_id"])
        values["time"] = parse_time(values["time"])
        return cls(**values)


RECORD_FIELDS = tuple(record_field.name for record_field in fields(AuditRecord))
# An event's columns: the record's, with the sequence number the log gives it after its id.
EVENT_FIELDS = ("event_id", "seq", *(name for name in RECORD_FIELDS if name != "event_id"))


def format_time(moment: datetime) -> str:
    if moment.tzinfo is None:  # SQLite returns naive datetimes; they are UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def event_payload(record: AuditRecord, seq: int) -> dict[str, Any]:
    """The hashed part of an event: every field, with its sequence number."""
    payload = record.to_json()
    payload["seq"] = seq
    return {name: payload[name] for name in EVENT_FIELDS}


def chain_hash(prev_hash: str, payload: dict[str, Any]) -> str:
    return hashlib.sha256((prev_hash + canonical_json(payload)).encode("utf-8")).hexdigest()


def sign(statement: dict[str, Any], key: str) -> str:
    """HMAC-SHA256 over the canonical JSON of a statement (a checkpoint or export trailer)."""
    return hmac.new(key.encode(), canonical_json(statement).encode(), hashlib.sha256).hexdigest()


def signature_valid(statement: dict[str, Any], signature: str, key: str) -> bool:
    return hmac.compare_digest(sign(statement, key), signature)
