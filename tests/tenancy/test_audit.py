"""The tamper-evident audit log: chain, checkpoints, export/verify, and nothing lost in outages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import make_url

from tenancy.audit_chain import AuditRecord, chain_hash
from tenancy.audit_export import ExportFilter, export_events
from tenancy.audit_verification import verify_database, verify_file
from tenancy.models import AuditCheckpoint, AuditEvent
from tenancy.store import Store
from tests.support.cli import Cli
from tests.support.tcp_proxy import TcpProxy


def record_many(store: Any, count: int, start: int = 0) -> None:
    for index in range(start, start + count):
        store.record(
            AuditRecord("cli", "tenant.create", "success", actor_id="ops",
                        details={"n": index, "note": "ünïcode ✓"})
        )  # fmt: skip


def export(store: Any, path: Path, file_format: str = "jsonl") -> Path:
    with store.transaction() as session:
        export_events(session, ExportFilter(), path, file_format, store.signing_key)
    return path


def events_in_db(store: Any) -> list[Any]:
    with store.transaction() as session:
        return list(session.scalars(select(AuditEvent).order_by(AuditEvent.seq)))


def test_an_untouched_chain_and_its_checkpoints_verify_in_the_database_and_exports(
    store: Any, tmp_path: Path
) -> None:
    record_many(store, 12)
    with store.transaction() as session:
        assert verify_database(session, store.signing_key).ok
        checkpoints = list(session.scalars(select(AuditCheckpoint.seq)))
    assert checkpoints == [5, 10]  # the store signs every 5 events
    for file_format in ("jsonl", "csv"):
        result = verify_file(
            export(store, tmp_path / f"a.{file_format}", file_format), "signing-key"
        )
        assert result.ok and result.events == 12, result.problem


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def tamper_edit(lines: list[str]) -> list[str]:
    event = json.loads(lines[3])
    event["details"]["n"] = 999
    return [*lines[:3], json.dumps(event), *lines[4:]]


def tamper_forged_insert(lines: list[str]) -> list[str]:
    event = json.loads(lines[3])
    event.update(seq=1000, event_id="00000000-0000-0000-0000-000000000000")
    payload = {k: event[k] for k in event if k not in ("record", "prev_hash", "hash")}
    event["hash"] = chain_hash(event["prev_hash"], payload)  # a self-consistent forgery
    return [*lines[:4], json.dumps(event), *lines[4:]]


TAMPERING = {
    "edit": (tamper_edit, "event seq=3 was modified"),
    "delete": (lambda lines: [*lines[:3], *lines[4:]], "event seq=3 was deleted"),
    "insert-duplicate": (lambda lines: [*lines[:5], lines[3], *lines[5:]], "seq=3 was inserted"),
    "insert-forged": (tamper_forged_insert, "event seq=1000 was inserted"),
    "reorder": (lambda lines: [*lines[:3], lines[4], lines[3], *lines[5:]], "seq=4 was reordered"),
    "truncate": (lambda lines: lines[:6], "truncated after seq=5"),
    "truncate-keeping-trailer": (lambda lines: [*lines[:6], lines[-1]], "truncated before seq=6"),
}


@pytest.fixture(scope="module")
def signed_export(migrated_template: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Eight audited CLI changes exported once by the real CLI; tests tamper with copies."""
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database(template=migrated_template)
    workdir = tmp_path_factory.mktemp("export")
    cli = Cli(database_url(name), workdir / "state")
    cli.ok("tenants", "create", "acme")
    store = Store.open(database_url(name), workdir / "spool", "k", "cli-signing-key", 100)
    record_many(store, 7)
    store.close()
    out = workdir / "audit.jsonl"
    assert "exported 8 events" in cli.ok("audit", "export", "--out", str(out))
    assert out.stat().st_mode & 0o777 == 0o600  # private, like the audit files it comes from
    assert cli.ok("audit", "verify", str(out)).startswith("ok: 8 events verified")
    yield cli, out
    drop_database(name)


@pytest.mark.parametrize("kind", sorted(TAMPERING))
def test_audit_verify_names_the_first_tampered_event(
    kind: str, signed_export: tuple[Cli, Path], tmp_path: Path
) -> None:
    cli, original = signed_export
    tamper, message = TAMPERING[kind]
    copy = tmp_path / "tampered.jsonl"
    copy.write_text("\n".join(tamper(lines_of(original))) + "\n")
    line = cli.error("audit", "verify", str(copy), code=1)
    assert line.startswith("prefixgate: audit verification FAILED") and message in line, line


def test_csv_export_detects_edits_too(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    cli.ok("tenants", "create", "globex")
    out = tmp_path / "audit.csv"
    cli.ok("audit", "export", "--out", str(out), "--format", "csv")
    assert cli.ok("audit", "verify", str(out)).startswith("ok: 2 events")
    out.write_text(out.read_text().replace("globex", "evilco"))
    assert "event seq=2 was modified" in cli.error("audit", "verify", str(out), code=1)


def test_the_export_itself_is_audited(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    cli.ok("audit", "export", "--out", str(tmp_path / "one.jsonl"))
    cli.ok("audit", "export", "--out", str(tmp_path / "two.jsonl"))
    second = [json.loads(line) for line in lines_of(tmp_path / "two.jsonl")]
    actions = [event["action"] for event in second if event["record"] == "event"]
    assert actions == ["tenant.create", "audit.export"]


def test_database_tampering_is_detected(store: Any) -> None:
    record_many(store, 12)
    edit = update(AuditEvent).where(AuditEvent.seq == 4).values(outcome="failure")
    checks = [
        (edit, "seq=4 was modified"),
        (delete(AuditEvent).where(AuditEvent.seq == 7), "seq=7 was deleted"),
        (delete(AuditEvent).where(AuditEvent.seq >= 11), "tail after seq=10 is missing"),
    ]  # fmt: skip
    for statement, message in checks:
        with store.transaction() as session:
            saved = [dict(vars(row)) for row in session.scalars(select(AuditEvent))]
            session.execute(statement)
        with store.transaction() as session:
            result = verify_database(session, store.signing_key)
        assert not result.ok and message in str(result.problem)
        with store.transaction() as session:  # restore for the next check
            session.execute(delete(AuditEvent))
            for row in saved:
                row.pop("_sa_instance_state", None)
                session.add(AuditEvent(**row))


def test_outage_spools_events_and_flushes_them_in_order(postgres_url: str, tmp_path: Path) -> None:
    url = make_url(postgres_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432).start()
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    store = Store.open(proxied, tmp_path / "audit.spool", "k", "signing-key", 5)
    try:
        record_many(store, 3)
        proxy.stop()  # the database is gone
        for index in range(3, 8):
            spooled = store.audit.record(AuditRecord("cli", "x", "success", details={"n": index}))
            assert spooled is False
        assert store.audit.pending() == 5
        proxy.start()  # it is back
        record_many(store, 1, start=8)
        assert store.audit.pending() == 0
        numbers = [event.details["n"] for event in events_in_db(store)]
        assert numbers == list(range(9))  # all of them, in order, once
        with store.transaction() as session:
            assert verify_database(session, "signing-key").ok
    finally:
        proxy.stop()
        store.close()


def test_crash_between_database_and_spool_clearing_never_duplicates(store: Any) -> None:
    record_many(store, 2)
    spooled = [AuditRecord("cli", "late", "success", details={"n": n}) for n in range(3)]
    store.audit._append_to_spool(spooled)
    store.audit._insert(spooled[:2])  # committed, then the process died before clearing
    assert store.audit.flush()
    with store.transaction() as session:
        assert session.scalar(select(func.count()).select_from(AuditEvent)) == 5
        assert verify_database(session, store.signing_key).ok
    late = [e.details["n"] for e in events_in_db(store) if e.action == "late"]
    assert late == [0, 1, 2]
