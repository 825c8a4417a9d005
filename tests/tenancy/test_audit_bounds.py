"""Every audit field is bounded before it is chained or spooled: nothing too long stalls the log."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select

from tenancy.audit_bounds import (
    FIELD_LENGTHS,
    MAX_DETAIL_STRING,
    MAX_DETAILS_CHARS,
    TOO_DEEP,
    bounded,
)
from tenancy.audit_chain import AuditRecord, canonical_json
from tenancy.audit_verification import verify_database
from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.cli import Cli


def stored_events(store: Store) -> list[AuditEvent]:
    with store.transaction() as session:
        return list(session.scalars(select(AuditEvent).order_by(AuditEvent.seq)))


def test_field_limits_come_from_the_audit_event_columns() -> None:
    assert FIELD_LENGTHS["source_ip"] == 64 and FIELD_LENGTHS["resource_id"] == 200
    assert set(FIELD_LENGTHS) >= {"actor_id", "tenant_id", "action", "request_id", "outcome"}


def test_too_long_fields_are_cut_to_their_column_and_flagged() -> None:
    record = AuditRecord(
        "gateway", "request", "success", source_ip="1" * 100, resource_id="acme/" + "k" * 200,
        details={"model": "m"},
    )  # fmt: skip
    fitted = bounded(record)
    assert fitted.source_ip == "1" * 64
    assert fitted.resource_id == ("acme/" + "k" * 200)[:200]
    assert fitted.details == {"model": "m", "truncated": ["resource_id", "source_ip"]}
    assert (fitted.event_id, fitted.time) == (record.event_id, record.time)


def test_a_record_that_fits_is_returned_unchanged() -> None:
    record = AuditRecord("cli", "tenant.create", "success", actor_id="ops", details={"n": 1})
    assert bounded(record) is record


def test_bounding_is_idempotent() -> None:
    record = AuditRecord(
        "gateway", "x\x00y", "success", source_ip="9" * 80,
        details={"long": "z" * 5000, "nan": math.nan, "deep": [[[[[[[[[[1]]]]]]]]]]},
    )  # fmt: skip
    once = bounded(record)
    assert bounded(once) == once


def test_details_are_plain_json_with_short_strings() -> None:
    marker = uuid.uuid4()
    details: dict[str, Any] = {
        "long": "z" * 5000,
        "nan": math.nan,
        "inf": -math.inf,
        "surrogate": "bad \udfff text",
        "nul": "a\x00b",
        "id": marker,
        "tuple": (1, 2),
        "deep": [[[[[[[[[[1]]]]]]]]]],
        7: "int key",
    }
    fitted = bounded(AuditRecord("gateway", "request", "success", details=details)).details
    assert fitted["long"] == "z" * MAX_DETAIL_STRING
    assert (fitted["nan"], fitted["inf"]) == ("nan", "-inf")
    assert fitted["surrogate"] == "bad \ufffd text" and fitted["nul"] == "a\ufffdb"
    assert fitted["id"] == str(marker) and fitted["tuple"] == [1, 2] and fitted["7"] == "int key"
    assert TOO_DEEP in canonical_json(fitted["deep"])
    assert fitted["truncated"] == ["details"] and fitted["sanitized"] == ["details"]
    canonical_json(fitted).encode("utf-8")  # hashable: every string encodes


def test_oversized_details_become_a_flagged_excerpt() -> None:
    details = {f"key{n}": "v" * 1000 for n in range(100)}  # ~100 KB of JSON
    fitted = bounded(AuditRecord("gateway", "request", "success", details=details)).details
    assert len(canonical_json(fitted)) <= MAX_DETAILS_CHARS
    assert fitted["truncated"] == ["details"] and fitted["excerpt"].startswith('{"key0":')


def test_unstorable_text_in_columns_is_replaced_and_flagged() -> None:
    fitted = bounded(AuditRecord("cli", "api_key.create", "success", actor_id="op\x00s\udfff"))
    assert fitted.actor_id == "op\ufffds\ufffd" and fitted.details == {"sanitized": ["actor_id"]}


def test_oversized_fields_reach_postgresql_flagged_and_nothing_queues_behind_them(
    postgres_url: str, tmp_path: Path
) -> None:
    store = Store.open(postgres_url, tmp_path / "audit.spool", "k", "signing-key", 5)
    try:
        long_ip = AuditRecord("gateway", "auth.failure", "failure", source_ip="1" * 100)
        long_key = AuditRecord("cli", "api_key.create", "success", resource_id="acme/" + "k" * 200)
        unstorable = AuditRecord(
            "cli", "api_key.create", "success", actor_id="a\x00b", details={"temperature": math.nan}
        )
        for record in (long_ip, long_key, unstorable):
            assert store.audit.record(record) is True  # written, not spooled as an "outage"
        for index in range(4):
            assert store.audit.record(AuditRecord("cli", "later", "success", details={"n": index}))
        assert store.audit.pending() == 0 and store.audit.dead_letters() == 0
        events = stored_events(store)
        assert [event.action for event in events][3:] == ["later"] * 4
        assert events[0].source_ip == "1" * 64 and events[0].details == {"truncated": ["source_ip"]}
        assert events[1].resource_id is not None and len(events[1].resource_id) == 200
        assert events[1].details == {"truncated": ["resource_id"]}
        assert events[2].actor_id == "a\ufffdb"
        assert events[2].details == {"temperature": "nan", "sanitized": ["actor_id", "details"]}
        with store.transaction() as session:
            result = verify_database(session, "signing-key")
        assert result.ok and result.events == 7, result.problem
    finally:
        store.close()


def test_cli_key_with_a_200_character_name_is_created_and_audited(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    name = "n" * 200
    created = cli.json("keys", "create", "--tenant", "acme", "--name", name)
    store = Store.open(postgres_url, tmp_path / "reader.spool", "cli-key-secret", "s", 100)
    try:
        key_events = [event for event in stored_events(store) if event.action == "api_key.create"]
    finally:
        store.close()
    assert len(key_events) == 1 and key_events[0].outcome == "success"
    assert key_events[0].resource_id == f"acme/{name}"[:200]
    assert key_events[0].details["truncated"] == ["resource_id"]
    assert created["name"] == name
    spool = tmp_path / "state" / "audit.spool"
    assert not spool.exists() or spool.read_text() == ""  # nothing waits behind it
