"""Data keys (tenancy/seal_keys.py) on PostgreSQL and SQLite: stable for their owner, stored only
wrapped by the master key, unreadable when moved or under another master key, one per owner
however many gateways ask at once, and gone for good with their tenant or prefix."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import select, update

from tenancy import prefixes, tenants
from tenancy.errors import NotFound
from tenancy.models import WrappedDataKey
from tenancy.seal_keys import (
    DataKey,
    DataKeyShredded,
    DataKeyUnreadable,
    prefix_data_key,
    shred_tenant_key,
    tenant_data_key,
)
from tenancy.store import Store

MASTER_KEY = bytes(range(32))
OTHER_MASTER_KEY = bytes(range(1, 33))
PROMPT = "You are a helpful assistant for every tenant."


def tenant_ids(store: Store, *slugs: str) -> list[uuid.UUID]:
    with store.transaction() as session:
        return [tenants.create_tenant(session, slug).id for slug in slugs]


def key_of(store: Store, tenant_id: uuid.UUID, master_key: bytes = MASTER_KEY) -> DataKey:
    with store.transaction() as session:
        return tenant_data_key(session, master_key, tenant_id)


def stored_rows(store: Store) -> list[WrappedDataKey]:
    with store.transaction() as session:
        return list(session.scalars(select(WrappedDataKey).order_by(WrappedDataKey.subject)))


def key_in_another_process(url: str, tenant_id: uuid.UUID) -> tuple[str, bytes]:
    """The tenant's data key as a separate Python process reads it from the database."""
    script = (
        "import sys, uuid\n"
        "from tenancy.db import make_engine, make_sessions\n"
        "from tenancy.seal_keys import tenant_data_key\n"
        "sessions = make_sessions(make_engine(sys.argv[1]))\n"
        "with sessions.begin() as session:\n"
        "    key = tenant_data_key(session, bytes.fromhex(sys.argv[2]), uuid.UUID(sys.argv[3]))\n"
        "print(key.key_id, key.secret.hex())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, url, MASTER_KEY.hex(), str(tenant_id)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    key_id, secret = done.stdout.split()
    return key_id, bytes.fromhex(secret)


def test_a_tenants_data_key_is_stable_across_calls_and_processes_and_its_own(
    store: Store, database: str
) -> None:
    acme, globex = tenant_ids(store, "acme", "globex")
    first = key_of(store, acme)
    assert re.fullmatch(rf"t-{acme.hex[:12]}-[0-9a-f]{{8}}", first.key_id)
    assert len(first.secret) == 32
    assert key_of(store, acme) == first  # read back, not made again
    assert key_in_another_process(database, acme) == (first.key_id, first.secret)
    other = key_of(store, globex)
    assert other.key_id != first.key_id and other.secret != first.secret
    assert [row.subject for row in stored_rows(store)] == sorted(
        [f"tenant:{acme}", f"tenant:{globex}"]
    )


def test_a_data_key_is_stored_only_wrapped_and_never_shown(store: Store) -> None:
    (acme,) = tenant_ids(store, "acme")
    key = key_of(store, acme)
    (row,) = stored_rows(store)
    assert row.key_id == key.key_id
    assert len(row.wrapped) == 12 + 32 + 16  # nonce, the sealed key, its tag
    columns = (row.subject, row.key_id, bytes(row.wrapped), str(row.created_at))
    for column in columns:
        held = column if isinstance(column, bytes) else column.encode()
        assert key.secret not in held and key.secret.hex().encode() not in held
    shown = repr(key)
    assert key.key_id in shown and key.secret.hex() not in shown and str(key.secret) not in shown


def test_wrapped_bytes_moved_onto_another_subject_do_not_unwrap(store: Store) -> None:
    acme, globex = tenant_ids(store, "acme", "globex")
    key_of(store, acme), key_of(store, globex)
    rows = {row.subject: bytes(row.wrapped) for row in stored_rows(store)}
    with store.transaction() as session:  # acme's wrapped key, pasted into globex's row
        session.execute(
            update(WrappedDataKey)
            .where(WrappedDataKey.subject == f"tenant:{globex}")
            .values(wrapped=rows[f"tenant:{acme}"])
        )
    with pytest.raises(DataKeyUnreadable, match="does not unwrap"):
        key_of(store, globex)
    key_of(store, acme)  # the original still reads
    with store.transaction() as session:  # acme's own bytes under another key id
        session.execute(
            update(WrappedDataKey)
            .where(WrappedDataKey.subject == f"tenant:{acme}")
            .values(key_id="t-000000000000-00000000")
        )
    with pytest.raises(DataKeyUnreadable):
        key_of(store, acme)


def test_another_master_key_fails_with_the_typed_error_and_makes_nothing(store: Store) -> None:
    (acme,) = tenant_ids(store, "acme")
    key = key_of(store, acme)
    before = [(row.key_id, bytes(row.wrapped)) for row in stored_rows(store)]
    with pytest.raises(DataKeyUnreadable):
        key_of(store, acme, OTHER_MASTER_KEY)
    assert [(row.key_id, bytes(row.wrapped)) for row in stored_rows(store)] == before
    assert key_of(store, acme) == key
    with pytest.raises(ValueError, match="32 bytes"):
        key_of(store, acme, MASTER_KEY[:16])


def keys_asked_at_once(store: Store, tenant_id: uuid.UUID, askers: int) -> set[DataKey]:
    """The keys `askers` threads get for a tenant, each in its own transaction, all at once."""
    start = threading.Barrier(askers)

    def ask(_: int) -> DataKey:
        start.wait()
        return key_of(store, tenant_id)

    with ThreadPoolExecutor(askers) as pool:
        return set(pool.map(ask, range(askers)))


def test_concurrent_creators_on_postgres_get_one_key(postgres_url: str, tmp_path: Any) -> None:
    store = Store.open(postgres_url, tmp_path / "spool", "key-secret", "signing-key")
    try:
        for round_ in range(5):  # each round a new tenant, its key asked for by 8 at once
            (tenant_id,) = tenant_ids(store, f"race-{round_}")
            keys = keys_asked_at_once(store, tenant_id, 8)
            assert len(keys) == 1
            assert keys == {key_of(store, tenant_id)}
        assert len(stored_rows(store)) == 5
    finally:
        store.close()


def test_deleting_a_tenant_shreds_its_key_for_good(store: Store) -> None:
    acme, globex = tenant_ids(store, "acme", "globex")
    key_of(store, acme)
    with store.transaction() as session:
        deleted = tenants.delete_tenant(session, "acme")
    assert deleted.data_key_shredded is True and deleted.tenant.status == "deleted"
    assert stored_rows(store) == []
    with pytest.raises(DataKeyShredded, match="deleted"):
        key_of(store, acme)
    assert stored_rows(store) == []  # refusing made nothing
    with store.transaction() as session:  # a tenant that never had a key
        assert tenants.delete_tenant(session, "globex").data_key_shredded is False
    with store.transaction() as session:
        assert shred_tenant_key(session, globex) is False
    with pytest.raises(NotFound):
        key_of(store, uuid.uuid4())


def test_deleting_a_prefix_shreds_its_key(store: Store) -> None:
    with store.transaction() as session:
        kept = prefixes.add_prefix(session, "m", "default", "kept", PROMPT, "test").id
        gone = prefixes.add_prefix(session, "m", "default", "gone", PROMPT, "test").id
    with store.transaction() as session:
        gone_key = prefix_data_key(session, MASTER_KEY, gone)
        kept_key = prefix_data_key(session, MASTER_KEY, kept)
    assert re.fullmatch(rf"p-{gone.hex[:12]}-[0-9a-f]{{8}}", gone_key.key_id)
    assert gone_key.secret != kept_key.secret
    with store.transaction() as session:
        assert prefixes.delete_prefix_by_id(session, gone) is True
    assert [row.subject for row in stored_rows(store)] == [f"prefix:{kept}"]
    with store.transaction() as session, pytest.raises(NotFound):
        prefix_data_key(session, MASTER_KEY, gone)
    with store.transaction() as session:
        assert prefix_data_key(session, MASTER_KEY, kept) == kept_key
        assert prefixes.delete_prefix(session, "m", "default", "kept") is True
        fresh = prefixes.add_prefix(session, "m", "default", "never-keyed", PROMPT, "test")
        assert prefixes.delete_prefix_by_id(session, fresh.id) is False
    assert stored_rows(store) == []


def test_a_key_asked_for_while_its_tenant_is_deleted_is_never_left_behind(
    postgres_url: str, tmp_path: Any
) -> None:
    """Either order of a deletion and a first key, in flight at once on PostgreSQL: no key of
    a deleted tenant survives, and a key asked for after the deletion is refused."""
    store = Store.open(postgres_url, tmp_path / "spool", "key-secret", "signing-key")
    try:
        # The deletion first: the key's maker waits for it and is refused.
        (first,) = tenant_ids(store, "first")
        deleting, done = threading.Event(), threading.Event()

        def delete_then_wait() -> None:
            with store.transaction() as session:
                tenants.delete_tenant(session, "first")
                deleting.set()
                time.sleep(0.5)  # the maker is waiting on the tenant's row meanwhile
            done.set()

        with ThreadPoolExecutor(2) as pool:
            deletion = pool.submit(delete_then_wait)
            assert deleting.wait(10)
            with pytest.raises(DataKeyShredded):
                key_of(store, first)
            assert done.is_set()  # it waited for the deletion to commit
            deletion.result()
        assert stored_rows(store) == []

        # The key first: the deletion waits for it and shreds it.
        (second,) = tenant_ids(store, "second")
        made = threading.Event()

        def make_then_wait() -> DataKey:
            with store.transaction() as session:
                key = tenant_data_key(session, MASTER_KEY, second)
                made.set()
                time.sleep(0.5)  # the deletion is waiting on the tenant's row meanwhile
            return key

        with ThreadPoolExecutor(2) as pool:
            making = pool.submit(make_then_wait)
            assert made.wait(10)
            with store.transaction() as session:
                assert tenants.delete_tenant(session, "second").data_key_shredded is True
            making.result()
        assert stored_rows(store) == []
    finally:
        store.close()
