"""Fitting an audit event to its columns, before it is chained or spooled.

Callers put whatever they saw into an `AuditRecord`: a header value, a key name, an error
message. The database refuses values longer than their column (PostgreSQL's `varchar(n)`),
JSON that is not JSON (NaN), and text it cannot store (NUL; a lone surrogate cannot even be
encoded). `bounded` makes every record storable: strings are cut to their column's length
(read from `AuditEvent`, so the limits have one home), `details` becomes plain JSON with
short strings and a size cap, and the record names what changed in `details["truncated"]`
(cut) and `details["sanitized"]` (characters or values replaced). It is idempotent: a record
bounded twice is the same record.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any

from sqlalchemy import String

from tenancy.audit_chain import AuditRecord, canonical_json
from tenancy.models import AuditEvent

MAX_DETAIL_STRING = 1024  # characters in one string inside `details`
MAX_DETAIL_KEY = 128
MAX_DETAIL_ITEMS = 256  # entries in one object or list inside `details`
MAX_DETAIL_DEPTH = 8
MAX_DETAILS_CHARS = 16384  # canonical JSON of the whole `details`
DETAILS_EXCERPT_CHARS = MAX_DETAIL_STRING  # what is kept of `details` still too large
REPLACEMENT = "\ufffd"
TOO_DEEP = "(nested too deep)"
TEXT_FIELDS = (
    "actor_type",
    "action",
    "outcome",
    "actor_id",
    "tenant_id",
    "resource_type",
    "resource_id",
    "request_id",
    "source_ip",
)
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _column_lengths() -> dict[str, int]:
    lengths = {}
    for name in TEXT_FIELDS:
        column_type = AuditEvent.__table__.columns[name].type
        assert isinstance(column_type, String) and column_type.length is not None, name
        lengths[name] = column_type.length
    return lengths


FIELD_LENGTHS = _column_lengths()


def bounded(record: AuditRecord) -> AuditRecord:
    """The record with every field storable; changed fields are named in its details."""
    walk = _Walk()
    changes: dict[str, Any] = {}
    for name in TEXT_FIELDS:
        value = getattr(record, name)
        if value is not None:
            text = walk.text(value, FIELD_LENGTHS[name], name)
            if text != value or not isinstance(value, str):
                changes[name] = text
    details = walk.details(record.details)
    if len(canonical_json(details)) > MAX_DETAILS_CHARS:
        walk.truncated.add("details")
        details = {"excerpt": canonical_json(details)[:DETAILS_EXCERPT_CHARS]}
    for flag, fields in (("truncated", walk.truncated), ("sanitized", walk.sanitized)):
        earlier = record.details.get(flag) if isinstance(record.details, dict) else None
        if fields:
            details[flag] = sorted(set(earlier if isinstance(earlier, list) else []) | fields)
    if details != record.details:
        changes["details"] = details
    return dataclasses.replace(record, **changes) if changes else record


class _Walk:
    """Copies fields into storable values, remembering which fields it cut or replaced."""

    def __init__(self) -> None:
        self.truncated: set[str] = set()
        self.sanitized: set[str] = set()

    def text(self, value: Any, limit: int, field: str) -> str:
        text = value if isinstance(value, str) else str(value)
        if text is not value:
            self.sanitized.add(field)  # a UUID, a datetime, bytes...: kept as its text
        if len(text) > limit:
            self.truncated.add(field)
            text = text[:limit]
        clean = _UNSTORABLE.sub(REPLACEMENT, text)
        if clean != text:
            self.sanitized.add(field)
        return clean

    def details(self, details: Any) -> dict[str, Any]:
        if not isinstance(details, dict):
            self.sanitized.add("details")
            details = {"value": details}
        value = self.value(details, 0)
        assert isinstance(value, dict)
        return value

    def value(self, value: Any, depth: int) -> Any:
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, str):
            return self.text(value, MAX_DETAIL_STRING, "details")
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            self.sanitized.add("details")  # JSON has no NaN or Infinity; PostgreSQL refuses them
            return str(value)
        if isinstance(value, dict | list | tuple):
            if depth >= MAX_DETAIL_DEPTH:
                self.truncated.add("details")
                return TOO_DEEP
            if len(value) > MAX_DETAIL_ITEMS:
                self.truncated.add("details")
            if isinstance(value, dict):
                items = itertools.islice(value.items(), MAX_DETAIL_ITEMS)
                return {
                    self.text(key, MAX_DETAIL_KEY, "details"): self.value(item, depth + 1)
                    for key, item in items
                }
            return [self.value(item, depth + 1) for item in value[:MAX_DETAIL_ITEMS]]
        return self.text(value, MAX_DETAIL_STRING, "details")
