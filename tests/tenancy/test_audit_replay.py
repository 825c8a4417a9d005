"""Dead letters replayed after a fix land in the chain exactly once, however the replay goes."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tenancy.audit_chain import AuditRecord
from tenancy.audit_files import UnreadableAuditFile, append_lines, dumps
from tenancy.audit_replay import ReplayResult, replay_dead_letters
from tenancy.audit_verification import verify_database
from tenancy.models import AuditEvent
from tenancy.store import Store
from tests.support.audit_refusal import fix, refuse

SIGNING_KEY = "signing-key"


def open_store(database: str, directory: Path) -> Store:
    return Store.open(
        database,
        directory / "audit.spool",
        "key-secret",
        SIGNING_KEY,
        3,  # a checkpoint every 3 events: replays cross several
        checkpoint_path=directory / "audit-checkpoints.jsonl",
    )


@pytest.fixture
def store(database: str, tmp_path: Path) -> Iterator[Store]:
    opened = open_store(database, tmp_path)
    yield opened
    opened.close()


def events(action: str, count: int) -> list[AuditRecord]:
    return [AuditRecord("gateway", action, "success", details={"n": n}) for n in range(count)]


def dead_letter(store: Store, records: list[AuditRecord]) -> None:
    """Record `records`, which the database refuses, so they end in the dead-letter file."""
    assert store.audit.record_many(records) is True  # refused, not spooled
    assert store.audit.dead_letters() >= len(records)


def stored_ids(store: Store) -> list[str]:
    with store.transaction() as session:
        return [str(event_id) for event_id in session.scalars(select(AuditEvent.event_id))]


def assert_chain_verifies(store: Store, events_expected: int) -> None:
    with store.transaction() as session:
        result = verify_database(session, SIGNING_KEY, store.audit.checkpoint_path)
    assert result.ok, result.problem
    assert result.events == events_expected


def counts(result: ReplayResult) -> tuple[int, int, int, int]:
    return (
        result.replayed,
        result.already_stored,
        len(result.still_failing),
        len(result.unreadable),
    )


def test_replay_stores_each_dead_letter_once_and_the_chain_verifies(store: Store) -> None:
    refuse(store, "poison", "refuse_poison")
    poison = events("poison", 4)
    store.audit.record_many([*events("request", 2), *poison, *events("request", 2)])
    assert store.audit.dead_letters() == 4
    fix(store, "refuse_poison")

    result = replay_dead_letters(store.audit, store.audit.dead_letter_path)

    assert counts(result) == (4, 0, 0, 0) and result.complete
    assert store.audit.dead_letters() == 0
    ids = stored_ids(store)
    assert sorted(ids) == sorted({*ids}) and {str(r.event_id) for r in poison} <= {*ids}
    with store.transaction() as session:
        replayed = session.scalars(select(AuditEvent).where(AuditEvent.action == "poison"))
        assert {(str(e.event_id), e.time) for e in replayed} == {
            (str(r.event_id), r.time) for r in poison
        }  # the same events, not copies: their own ids and times
    assert_chain_verifies(store, 8)


def test_running_the_replay_again_changes_nothing(store: Store, tmp_path: Path) -> None:
    refuse(store, "poison", "refuse_poison")
    dead_letter(store, events("poison", 3))
    fix(store, "refuse_poison")
    old_copy = tmp_path / "copy.jsonl"
    shutil.copy(store.audit.dead_letter_path, old_copy)
    assert counts(replay_dead_letters(store.audit, store.audit.dead_letter_path)) == (3, 0, 0, 0)

    again = replay_dead_letters(store.audit, store.audit.dead_letter_path)
    from_the_old_copy = replay_dead_letters(store.audit, old_copy)

    assert counts(again) == (0, 0, 0, 0)
    assert counts(from_the_old_copy) == (0, 3, 0, 0)
    assert old_copy.read_text() == ""
    assert len(stored_ids(store)) == 3
    assert_chain_verifies(store, 3)


class Interrupted(Exception):
    """Stands for the process dying (Ctrl-C, a kill) between two batches."""


def test_an_interrupted_replay_then_a_rerun_stores_each_event_exactly_once(store: Store) -> None:
    refuse(store, "poison", "refuse_poison")
    poison = events("poison", 5)
    dead_letter(store, poison)
    fix(store, "refuse_poison")
    file_before = store.audit.dead_letter_path.read_bytes()

    def interrupt_after_the_first_batch(done: int, _total: int) -> None:
        if done > 0:
            raise Interrupted

    with pytest.raises(Interrupted):
        replay_dead_letters(
            store.audit, store.audit.dead_letter_path, interrupt_after_the_first_batch, batch=2
        )
    assert store.audit.dead_letter_path.read_bytes() == file_before  # the file is untouched
    assert len(stored_ids(store)) == 2  # the first batch committed

    result = replay_dead_letters(store.audit, store.audit.dead_letter_path, batch=2)

    assert counts(result) == (3, 2, 0, 0)
    assert sorted(stored_ids(store)) == sorted(str(r.event_id) for r in poison)
    assert store.audit.dead_letters() == 0
    assert_chain_verifies(store, 5)


def test_an_event_still_refused_stays_in_the_file_with_the_new_reason(store: Store) -> None:
    refuse(store, "poison", "refuse_poison")
    refuse(store, "venom", "refuse_venom")
    (poison,), (venom,) = events("poison", 1), events("venom", 1)
    dead_letter(store, [poison, venom])
    fix(store, "refuse_poison")
    fix(store, "refuse_venom")
    refuse(store, "venom", "refuse_venom_again")  # the fix did not cover venom after all

    result = replay_dead_letters(store.audit, store.audit.dead_letter_path)

    assert counts(result) == (1, 0, 1, 0) and not result.complete
    (failing,) = result.still_failing
    assert (failing.line, failing.event_id) == (2, str(venom.event_id))
    assert "refuse_venom_again" in failing.reason
    (kept,) = store.audit.dead_letter_path.read_text().splitlines()
    assert f'"event_id": "{venom.event_id}"' in kept and "refuse_venom_again" in kept
    assert stored_ids(store) == [str(poison.event_id)]
    assert_chain_verifies(store, 1)


def test_a_corrupt_line_is_reported_with_its_number_and_kept(store: Store) -> None:
    refuse(store, "poison", "refuse_poison")
    (poison,) = events("poison", 1)
    dead_letter(store, [poison])
    fix(store, "refuse_poison")
    unparsed_spool_line = dumps({"error": "ValueError", "event": {"unparsed_spool_line": "{x"}})
    corrupt = [b"{not json", b'{"not": "a dead letter"}', unparsed_spool_line.encode(), b"\xff\xfe"]
    path = store.audit.dead_letter_path
    with path.open("ab") as file:
        file.write(b"".join(line + b"\n" for line in corrupt))

    result = replay_dead_letters(store.audit, path)

    assert counts(result) == (1, 0, 0, 4)
    assert [(bad.line, bad.problem) for bad in result.unreadable] == [
        (2, "not JSON"),
        (3, "not a dead letter (no event)"),
        (4, "a spool line that never parsed, not an event"),
        (5, "not UTF-8 text"),
    ]
    assert path.read_bytes() == b"".join(line + b"\n" for line in corrupt)  # kept verbatim
    assert stored_ids(store) == [str(poison.event_id)]


def test_a_missing_or_foreign_file_is_refused_and_left_alone(store: Store, tmp_path: Path) -> None:
    with pytest.raises(UnreadableAuditFile, match="No such file or directory"):
        replay_dead_letters(store.audit, tmp_path / "missing.jsonl")
    with pytest.raises(UnreadableAuditFile, match="not a regular file"):
        replay_dead_letters(store.audit, tmp_path)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello\n{}\n")
    with pytest.raises(UnreadableAuditFile, match=r"not a dead-letter file \(line 1: not JSON\)"):
        replay_dead_letters(store.audit, foreign)
    assert foreign.read_text() == "hello\n{}\n"
    assert stored_ids(store) == []


def test_a_dead_letter_kept_twice_by_a_crash_is_stored_once(store: Store) -> None:
    refuse(store, "poison", "refuse_poison")
    (poison,) = events("poison", 1)
    dead_letter(store, [poison])
    fix(store, "refuse_poison")
    path = store.audit.dead_letter_path
    append_lines(path, path.read_text().splitlines())

    result = replay_dead_letters(store.audit, path)

    assert counts(result) == (1, 0, 0, 0)
    assert stored_ids(store) == [str(poison.event_id)] and path.read_text() == ""


def test_two_replays_at_once_store_each_event_once(postgres_url: str, tmp_path: Path) -> None:
    """Two hosts with a copy of one dead-letter file replay it into one database together."""
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    stores = [open_store(postgres_url, host) for host in hosts]
    try:
        refuse(stores[0], "poison", "refuse_poison")
        poison = events("poison", 30)
        dead_letter(stores[0], poison)
        fix(stores[0], "refuse_poison")
        hosts[1].mkdir()
        shutil.copy(stores[0].audit.dead_letter_path, stores[1].audit.dead_letter_path)
        results: list[ReplayResult] = []
        start = threading.Barrier(2)

        def replay(store: Store) -> None:
            start.wait()
            results.append(replay_dead_letters(store.audit, store.audit.dead_letter_path, batch=3))

        threads = [threading.Thread(target=replay, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert len(results) == 2
        assert sum(result.replayed for result in results) == 30
        assert sum(result.already_stored for result in results) == 30
        with stores[0].transaction() as session:
            assert session.scalar(select(func.count()).select_from(AuditEvent)) == 30
        assert sorted(stored_ids(stores[0])) == sorted(str(r.event_id) for r in poison)
        with stores[0].transaction() as session:
            assert verify_database(session, SIGNING_KEY).ok
    finally:
        for store in stores:
            store.close()
