"""`prefixgate audit replay-dead-letters` through the real console script, on both databases."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.audit_refusal import fix, refuse
from tests.support.cli import Cli


@pytest.fixture
def reader(database: str, tmp_path: Path) -> Iterator[Store]:
    """The test's own handle on the CLI's database (to refuse, fix and read events)."""
    store = Store.open(database, tmp_path / "reader" / "audit.spool", "k", "s", 100)
    yield store
    store.close()


def actions(store: Store) -> list[tuple[str, str]]:
    with store.transaction() as session:
        events = session.scalars(select(AuditEvent).order_by(AuditEvent.seq))
        return [(event.action, event.outcome) for event in events]


def refused_tenant_create(cli: Cli, reader: Store) -> Path:
    """A `tenants create` whose audit event the database refused; returns the dead-letter file."""
    refuse(reader, "tenant.create", "refuse_tenant_create")
    cli.ok("tenants", "create", "acme")
    path = Path(cli.env["PREFIXGATE_STATE_DIR"]) / "audit.dead-letters.jsonl"
    assert len(path.read_text().splitlines()) == 1
    assert actions(reader) == []
    return path


def test_replay_stores_the_refused_event_once_and_verify_passes(
    database: str, tmp_path: Path, reader: Store
) -> None:
    cli = Cli(database, tmp_path / "state")
    path = refused_tenant_create(cli, reader)
    old_copy = tmp_path / "copy.jsonl"
    shutil.copy(path, old_copy)
    fix(reader, "refuse_tenant_create")

    assert cli.ok("audit", "replay-dead-letters") == "replayed 1, already in 0, still failing 0\n"
    assert path.read_text() == ""
    assert "events verified" in cli.ok("audit", "verify", "--database")
    assert cli.ok("audit", "replay-dead-letters") == "replayed 0, already in 0, still failing 0\n"
    replay_of_the_old_copy = cli.ok("audit", "replay-dead-letters", "--file", str(old_copy))
    assert replay_of_the_old_copy == "replayed 0, already in 1, still failing 0\n"

    assert actions(reader) == [
        ("tenant.create", "success"),
        *[("audit.replay_dead_letters", "success")] * 3,
    ]
    assert "events verified" in cli.ok("audit", "verify", "--database")


def test_an_event_still_refused_exits_1_names_its_line_and_stays(
    database: str, tmp_path: Path, reader: Store
) -> None:
    cli = Cli(database, tmp_path / "state")
    path = refused_tenant_create(cli, reader)
    before = path.read_text()

    completed = cli.run("audit", "replay-dead-letters")

    assert completed.returncode == 1
    (line,) = completed.stderr.splitlines()
    assert line.startswith("prefixgate: line 1: event ") and "refuse_tenant_create" in line
    assert completed.stdout == f"replayed 0, already in 0, still failing 1; kept in {path}\n"
    assert path.read_text().split('"event": ')[1] == before.split('"event": ')[1]
    assert actions(reader) == [("audit.replay_dead_letters", "failure")]


def test_a_corrupt_line_is_reported_by_number_and_kept(
    database: str, tmp_path: Path, reader: Store
) -> None:
    cli = Cli(database, tmp_path / "state")
    path = refused_tenant_create(cli, reader)
    fix(reader, "refuse_tenant_create")
    with path.open("a") as file:
        file.write('{"torn": \n')

    completed = cli.run("audit", "replay-dead-letters")

    assert completed.returncode == 1
    assert completed.stderr == "prefixgate: line 2: not JSON; kept\n"
    assert completed.stdout == (
        f"replayed 1, already in 0, still failing 0, unreadable lines 1; kept in {path}\n"
    )
    assert path.read_text() == '{"torn": \n'
    assert [action for action, _ in actions(reader)] == [
        "tenant.create",
        "audit.replay_dead_letters",
    ]


def test_a_missing_or_foreign_file_is_one_line_and_a_host_without_dead_letters_is_fine(
    database: str, tmp_path: Path
) -> None:
    cli = Cli(database, tmp_path / "state")
    missing = tmp_path / "missing.jsonl"
    assert cli.error("audit", "replay-dead-letters", "--file", str(missing)) == (
        f"prefixgate: error: cannot read {missing}: No such file or directory"
    )
    assert cli.error("audit", "replay-dead-letters", "--file", str(tmp_path)) == (
        f"prefixgate: error: cannot read {tmp_path}: not a regular file"
    )
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert cli.error("audit", "replay-dead-letters", "--file", str(foreign)) == (
        f"prefixgate: error: {foreign} is not a dead-letter file (line 1: not UTF-8 text)"
    )
    assert foreign.read_bytes() == b"\x89PNG\r\n\x1a\n\x00\x00"
    assert cli.ok("audit", "replay-dead-letters") == (
        f"no dead letters: {tmp_path / 'state' / 'audit.dead-letters.jsonl'} does not exist\n"
    )
