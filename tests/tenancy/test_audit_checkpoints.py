"""Signed checkpoints are also kept outside the database, so a cut-off tail is detected."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, select, update

from gateway.runtime.audit_queue import AuditQueue
from tenancy.audit_chain import AuditRecord, signature_valid
from tenancy.audit_files import UnreadableAuditFile, read_checkpoints
from tenancy.audit_verification import VerifyResult, verify_database
from tenancy.models import AuditCheckpoint, AuditEvent, AuditHead
from tenancy.store import Store
from tests.support.cli import Cli


@pytest.fixture
def store(postgres_url: str, tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(
        postgres_url, tmp_path / "audit.spool", "k", "signing-key", 5,
        checkpoint_path=tmp_path / "audit-checkpoints.jsonl",
    )  # fmt: skip
    yield opened
    opened.close()


def record_many(store: Store, count: int) -> None:
    for index in range(count):
        store.record(AuditRecord("cli", "tenant.create", "success", details={"n": index}))


def cut_tail(store: Store, keep: int) -> None:
    """The attack: delete the last events and their checkpoints, move the head back."""
    with store.transaction() as session:
        session.execute(delete(AuditEvent).where(AuditEvent.seq > keep))
        session.execute(delete(AuditCheckpoint).where(AuditCheckpoint.seq > keep))
        last = session.scalars(select(AuditEvent.hash).where(AuditEvent.seq == keep)).one()
        session.execute(update(AuditHead).values(seq=keep, hash=last))


def verify(store: Store, checkpoint_path: Path | None) -> VerifyResult:
    with store.transaction() as session:
        return verify_database(session, "signing-key", checkpoint_path)


def file_of(store: Store) -> Path:
    assert store.audit.checkpoint_path is not None
    return store.audit.checkpoint_path


def test_every_checkpoint_is_also_appended_to_a_private_file(store: Store) -> None:
    record_many(store, 12)
    assert [c.seq for c in read_checkpoints(file_of(store))] == [5, 10]
    store.audit.checkpoint_now()
    checkpoints = read_checkpoints(file_of(store))
    assert [c.seq for c in checkpoints] == [5, 10, 12]
    for checkpoint in checkpoints:
        statement = {"seq": checkpoint.seq, "hash": checkpoint.hash}
        assert signature_valid(statement, checkpoint.signature, "signing-key")
    assert stat.S_IMODE(file_of(store).stat().st_mode) == 0o600
    assert verify(store, file_of(store)).ok


def test_a_cut_off_tail_is_detected_through_the_checkpoint_file(store: Store) -> None:
    record_many(store, 12)
    store.audit.checkpoint_now()
    cut_tail(store, keep=8)
    assert verify(store, None).ok  # the database alone cannot tell
    result = verify(store, file_of(store))
    assert not result.ok
    assert result.problem == "the chain ends at seq=8 but the checkpoint file attests seq=12"


def test_a_cut_tail_that_grew_back_is_detected(store: Store) -> None:
    record_many(store, 12)
    cut_tail(store, keep=8)
    record_many(store, 6)  # new events at seq 9..14 hide the cut from a length check
    result = verify(store, file_of(store))
    assert not result.ok
    assert result.problem == "events up to checkpoint seq=10 in the file are missing or changed"


def test_a_forged_line_in_the_checkpoint_file_is_detected(store: Store) -> None:
    record_many(store, 6)
    forged = {"seq": 6, "hash": "f" * 64, "signature": "0" * 64}
    with open(file_of(store), "a") as handle:
        handle.write(json.dumps(forged) + "\n")
    result = verify(store, file_of(store))
    assert not result.ok and result.problem == "checkpoint seq=6 in the file is forged"


def test_a_torn_last_line_is_ignored_but_a_corrupt_line_is_unreadable(store: Store) -> None:
    record_many(store, 5)
    path = file_of(store)
    with open(path, "a") as handle:
        handle.write('{"seq": 9, "ha')  # a crash mid-append
    assert [c.seq for c in read_checkpoints(path)] == [5]
    assert verify(store, path).ok
    path.write_text(path.read_text() + 'sh": "x"}\n[]\n')
    with pytest.raises(UnreadableAuditFile, match="line 2 is not a checkpoint"):
        verify(store, path)


def test_the_audit_writer_checkpoints_after_writing_once_the_interval_passed(
    store: Store,
) -> None:
    writer = AuditQueue(store.audit, checkpoint_interval_s=0.0)
    for index in range(3):
        writer.put(AuditRecord("gateway", "request", "success", details={"n": index}))
    writer.join()
    writer.drain()
    signed = [c.seq for c in read_checkpoints(file_of(store))]
    assert signed[-1] == 3  # (after each batch the writer found: 1 to 3 of them)
    slow = AuditQueue(store.audit, checkpoint_interval_s=3600.0)
    for index in range(2):
        slow.put(AuditRecord("gateway", "request", "success", details={"n": index}))
    slow.join()
    assert [c.seq for c in read_checkpoints(file_of(store))] == [*signed, 5]  # the log's every 5
    slow.put(AuditRecord("gateway", "request", "success", details={"n": 2}))
    slow.join()
    assert [c.seq for c in read_checkpoints(file_of(store))] == [*signed, 5]  # not due yet
    slow.drain()  # stopping signs what was written
    assert [c.seq for c in read_checkpoints(file_of(store))] == [*signed, 5, 6]
    with store.transaction() as session:
        seqs = select(AuditCheckpoint.seq).order_by(AuditCheckpoint.seq)
        assert list(session.scalars(seqs)) == [*signed, 5, 6]


def test_audit_verify_database_detects_a_cut_tail(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    for slug in ("acme", "globex", "initech", "umbrella"):
        cli.ok("tenants", "create", slug)
    cli.ok("audit", "export", "--out", str(tmp_path / "audit.jsonl"))  # signs seq=4
    assert cli.ok("audit", "verify", "--database").startswith("ok: 5 events verified")
    store = Store.open(postgres_url, tmp_path / "reader.spool", "cli-key-secret", "s", 100)
    try:
        cut_tail(store, keep=2)
    finally:
        store.close()
    line = cli.error("audit", "verify", "--database", code=1)
    assert "the chain ends at seq=2 but the checkpoint file attests seq=4" in line, line
