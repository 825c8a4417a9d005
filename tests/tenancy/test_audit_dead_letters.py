"""An event the database refuses is a dead letter, not an outage: it never blocks the others."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from tenancy.audit_chain import AuditRecord
from tenancy.audit_files import append_lines
from tenancy.audit_verification import verify_database
from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.cli import Cli
from tests.support.tcp_proxy import TcpProxy

# Real ways for PostgreSQL to refuse one event that `bounded` cannot foresee: a schema stricter
# than the models (an operator's constraint, a narrower column, a stricter type). They raise an
# IntegrityError, a DataError and a ProgrammingError: the database refusing data, not an outage.
REFUSALS = {
    "integrity-error": (
        "ALTER TABLE audit_events ADD CONSTRAINT no_poison CHECK (action <> 'poison')",
        {"action": "poison"},
        "CheckViolation",
    ),
    "data-error": (
        "ALTER TABLE audit_events ALTER COLUMN request_id TYPE varchar(8)",
        {"request_id": "r" * 50},
        "StringDataRightTruncation",
    ),
    "programming-error": (
        "ALTER TABLE audit_events ALTER COLUMN source_ip TYPE inet USING source_ip::inet",
        {"source_ip": "not an address"},
        "DatatypeMismatch",
    ),
}


@pytest.fixture
def store(postgres_url: str, tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(postgres_url, tmp_path / "audit.spool", "k", "signing-key", 5)
    yield opened
    opened.close()


def refuse(store: Store, kind: str) -> AuditRecord:
    """Make the database refuse one kind of event; returns such an event."""
    statement, fields, _ = REFUSALS[kind]
    with store.transaction() as session:
        session.execute(text(statement))
    return AuditRecord(**{"actor_type": "gateway", "action": "request", "outcome": "success",
                          **fields})  # fmt: skip


def numbered(count: int, start: int = 0) -> list[AuditRecord]:
    return [
        AuditRecord("gateway", "request", "success", details={"n": n})
        for n in range(start, start + count)
    ]


def stored_numbers(store: Store) -> list[int]:
    with store.transaction() as session:
        events = session.scalars(select(AuditEvent).order_by(AuditEvent.seq))
        return [event.details["n"] for event in events]


def dead_lettered(store: Store) -> list[dict[str, object]]:
    lines = store.audit.dead_letter_path.read_text().splitlines()
    return [json.loads(line) for line in lines]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_refused_event_in_a_batch_is_dead_lettered_and_the_rest_land(
    kind: str, store: Store
) -> None:
    poison = refuse(store, kind)
    batch = [*numbered(3), poison, *numbered(3, start=3)]
    assert store.audit.record_many(batch) is True  # not an outage: nothing spooled
    assert store.audit.record(numbered(1, start=6)[0]) is True
    assert stored_numbers(store) == list(range(7))
    assert store.audit.pending() == 0 and store.audit.dead_letters() == 1
    (letter,) = dead_lettered(store)
    assert letter["event"]["event_id"] == str(poison.event_id)  # type: ignore[index]
    assert str(letter["error"]).startswith(REFUSALS[kind][2])
    assert store.audit.dead_letter_path.parent == store.audit.spool_path.parent
    assert mode_of(store.audit.dead_letter_path) == 0o600
    with store.transaction() as session:
        result = verify_database(session, "signing-key")
    assert result.ok and result.events == 7, result.problem


def test_a_refused_event_spooled_before_an_outage_does_not_stall_the_spool(
    postgres_url: str, tmp_path: Path
) -> None:
    url = make_url(postgres_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432).start()
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    store = Store.open(proxied, tmp_path / "audit.spool", "k", "signing-key", 5)
    try:
        poison = refuse(store, "integrity-error")
        proxy.stop()  # the database is gone: everything is spooled, the refused one too
        for record in [*numbered(2), poison, *numbered(2, start=2)]:
            assert store.audit.record(record) is False
        assert store.audit.pending() == 5
        assert mode_of(store.audit.spool_path) == 0o600
        proxy.start()
        assert store.audit.record(numbered(1, start=4)[0]) is True
        assert store.audit.pending() == 0 and store.audit.dead_letters() == 1
        assert stored_numbers(store) == list(range(5))
    finally:
        proxy.stop()
        store.close()


def test_a_spool_poisoned_by_an_older_version_drains(postgres_url: str, tmp_path: Path) -> None:
    """The spool an older version left (a too-long value, a corrupt line) flushes on restart."""
    spool = tmp_path / "state" / "audit.spool"
    spool.parent.mkdir()
    too_long = AuditRecord("gateway", "auth.failure", "failure", source_ip="1" * 100)
    later = AuditRecord("gateway", "request", "success", details={"n": 0})
    spool.write_text(
        json.dumps(too_long.to_json()) + "\n" + "{not json\n" + json.dumps(later.to_json()) + "\n"
    )
    cli = Cli(postgres_url, tmp_path / "state")
    output = cli.ok("audit", "flush")
    assert "flushed 2 spooled events" in output
    assert f"1 events the database refused are kept in {spool.parent}" in output
    store = Store.open(postgres_url, tmp_path / "reader.spool", "k", "s", 100)
    try:
        with store.transaction() as session:
            events = list(session.scalars(select(AuditEvent).order_by(AuditEvent.seq)))
    finally:
        store.close()
    assert [event.event_id for event in events] == [too_long.event_id, later.event_id]
    assert events[0].details == {"truncated": ["source_ip"]}
    assert spool.read_text() == ""


def test_a_long_spool_is_written_in_chunks_past_a_refused_event(store: Store) -> None:
    poison = refuse(store, "integrity-error")
    records = [*numbered(550), poison, *numbered(49, start=550)]  # past one chunk of 500
    lines = [json.dumps(record.to_json()) for record in records]
    append_lines(store.audit.spool_path, lines)  # what a long outage left behind
    assert store.audit.flush() is True
    assert stored_numbers(store) == list(range(599))
    assert store.audit.pending() == 0 and store.audit.dead_letters() == 1
    with store.transaction() as session:
        assert verify_database(session, "signing-key").ok
