"""The tenancy change counter and column bounds, on PostgreSQL and SQLite (the `store` fixture)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tenancy import api_keys, tenants
from tenancy import change_feed as changes
from tenancy.api_keys import VerifiedKey
from tenancy.errors import InvalidInput
from tenancy.models import ApiKey, PublicPrefix, Tenant
from tenancy.prefixes import add_prefix
from tenancy.seal_keys import tenant_data_key
from tenancy.store import Store
from tenancy.tenants import TenantLimits

SECRET = "key-secret"  # the `store` fixture's key-hashing secret


def seq(store: Store) -> int:
    with store.transaction() as session:
        return changes.current_seq(session)


def key_id(session: Session, slug: str) -> str:
    owner = tenants.get_tenant(session, slug)
    return next(k.key_id for k in api_keys.list_keys(session, owner.id) if k.revoked_at is None)


def new_key(session: Session, slug: str) -> None:
    api_keys.create_key(session, tenants.get_tenant(session, slug), "ci", SECRET)


def rotate(session: Session, slug: str) -> None:
    owner = tenants.get_tenant(session, slug)
    api_keys.rotate_key(session, owner, key_id(session, slug), SECRET, timedelta(hours=1))


def revoke(session: Session, slug: str) -> None:
    owner = tenants.get_tenant(session, slug)
    api_keys.revoke_key(session, owner.id, key_id(session, slug))


def set_limits_in_bulk(session: Session, slug: str) -> None:
    session.execute(update(Tenant).where(Tenant.slug == slug).values(requests_per_minute=5))


EVERY_CHANGE: list[tuple[str, Callable[[Session], object]]] = [
    ("create tenant", lambda s: tenants.create_tenant(s, "acme")),
    ("set quota", lambda s: tenants.set_quota(s, "acme", 64)),
    ("set reservation", lambda s: tenants.set_quota(s, "acme", reservation_blocks=8)),
    ("set sharing", lambda s: tenants.set_sharing(s, "acme", "tenant")),
    ("set limits (bulk statement)", lambda s: set_limits_in_bulk(s, "acme")),
    ("set scheduling weight", lambda s: tenants.set_scheduling_weight(s, "acme", 2.5)),
    ("set tier quota", lambda s: tenants.set_quota(s, "acme", tier_quota_bytes=1 << 30)),
    ("tier quota back to default", lambda s: tenants.set_quota(s, "acme", tier_quota_bytes=None)),
    ("suspend", lambda s: tenants.set_status(s, "acme", "suspended")),
    ("resume", lambda s: tenants.set_status(s, "acme", "active")),
    ("create key", lambda s: new_key(s, "acme")),
    ("rotate key", lambda s: rotate(s, "acme")),
    ("revoke key", lambda s: revoke(s, "acme")),
    ("delete tenant", lambda s: tenants.delete_tenant(s, "acme")),
]


def test_every_committed_tenancy_change_moves_the_counter(store: Store) -> None:
    before = seq(store)
    for name, change in EVERY_CHANGE:
        with store.transaction() as session:
            change(session)
        after = seq(store)
        assert after > before, f"{name} did not move the change counter"
        before = after


def test_authentication_reads_and_other_tables_do_not_move_the_counter(store: Store) -> None:
    with store.transaction() as session:
        created = api_keys.create_key(session, tenants.create_tenant(session, "acme"), "k", SECRET)
    before = seq(store)
    with store.transaction() as session:  # writes last_used_at, on every request
        assert isinstance(api_keys.authenticate(session, created.secret, SECRET), VerifiedKey)
    with store.transaction() as session:
        assert session.get(ApiKey, created.key.id).last_used_at is not None  # type: ignore[union-attr]
        tenants.list_tenants(session)
        add_prefix(session, "m", "default", "p", "You are helpful.", "test")
        session.execute(update(PublicPrefix).values(enabled=False))
        tenant_data_key(session, bytes(32), created.key.tenant_id)  # a data key, made
    assert seq(store) == before


def test_refused_and_rolled_back_changes_do_not_move_the_counter(store: Store) -> None:
    with store.transaction() as session:
        tenants.create_tenant(session, "acme")
    before = seq(store)
    with pytest.raises(InvalidInput), store.transaction() as session:
        tenants.set_quota(session, "acme", 4, 9)
    with pytest.raises(RuntimeError), store.transaction() as session:
        tenants.set_quota(session, "acme", 4)
        raise RuntimeError("the caller failed after the change")
    assert seq(store) == before
    with store.transaction() as session:
        assert tenants.get_tenant(session, "acme").cache_quota_blocks == 1024


def test_tenant_budgets_show_the_latest_quota_and_deleted_tenants(store: Store) -> None:
    with store.transaction() as session:
        acme = tenants.create_tenant(session, "acme", limits=TenantLimits(32, 4))
        globex = tenants.create_tenant(session, "globex")
    with store.transaction() as session:
        tenants.set_quota(session, "acme", 48)
        tenants.delete_tenant(session, "globex")
    with store.transaction() as session:
        budgets = changes.tenant_budgets(session)
    assert budgets[str(acme.id)] == changes.TenantRow(str(acme.id), "acme", "active", 48, 4)
    assert budgets[str(globex.id)].status == "deleted"
    with store.transaction() as session:  # the second tier's budget travels on the same row
        tenants.set_quota(session, "acme", tier_quota_bytes=5 << 30, tier_reservation_bytes=1)
        budgets = changes.tenant_budgets(session)
    assert budgets[str(acme.id)] == changes.TenantRow(
        str(acme.id), "acme", "active", 48, 4, tier_quota_bytes=5 << 30, tier_reservation_bytes=1
    )


TOO_LARGE: list[tuple[str, Callable[[Session], Any], str]] = [
    ("display name", lambda s: tenants.create_tenant(s, "acme", "x" * 201), "display_name"),
    ("key name", lambda s: api_keys.create_key(s, tenants.create_tenant(s, "acme"), "k" * 201,
                                               SECRET), "name"),
    ("requests per minute", lambda s: tenants.create_tenant(
        s, "acme", limits=TenantLimits(requests_per_minute=2**31)), "requests_per_minute"),
    ("quota", lambda s: tenants.create_tenant(s, "acme", limits=TenantLimits(2**31)),
     "cache_quota_blocks"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "write", "field"), TOO_LARGE, ids=[c[0] for c in TOO_LARGE])
def test_a_value_too_large_for_its_column_is_invalid_input_naming_the_field(
    what: str, write: Callable[[Session], Any], field: str, store: Store
) -> None:
    with pytest.raises(InvalidInput) as raised, store.transaction() as session:
        write(session)
    assert raised.value.field == field and field in str(raised.value)
    with store.transaction() as session:  # and nothing was written
        assert session.scalars(select(Tenant)).all() == []


def test_a_listener_hears_every_committed_change_at_once_and_nothing_else(
    postgres_url: str, tmp_path: Path
) -> None:
    """PostgreSQL's NOTIFY, sent by the counter's bump: delivered when the change commits (in
    milliseconds), never for a rollback or for writes that are not changes."""
    store = Store.open(postgres_url, tmp_path / "audit.spool", SECRET, "signing-key", 5)
    heard = threading.Event()
    calls: list[float] = []

    def on_change() -> None:
        calls.append(time.monotonic())
        heard.set()

    listener = changes.ChangeListener(store.engine, on_change).start()
    try:
        deadline = time.monotonic() + 10
        while not listener.listening:
            assert time.monotonic() < deadline, "the listener never listened"
            time.sleep(0.02)
        assert heard.wait(5)  # once on connecting, for what it may have missed
        time.sleep(0.2)
        heard.clear()
        with pytest.raises(RuntimeError), store.transaction() as session:
            tenants.create_tenant(session, "rolled-back")
            raise RuntimeError("the caller failed")
        with store.transaction() as session:
            add_prefix(session, "m", "default", "p", "You are helpful.", "test")
        assert not heard.wait(0.5)  # neither a rollback nor a write that is no change
        latencies = []
        for slug in ("acme", "globex", "initech"):
            heard.clear()
            with store.transaction() as session:
                tenants.create_tenant(session, slug)
                committing = time.monotonic()
            assert heard.wait(5), f"creating {slug} was not heard"
            latencies.append(calls[-1] - committing)
        assert max(latencies) < 0.5, latencies
    finally:
        listener.stop()
        store.close()


def test_a_listener_on_sqlite_leaves_it_to_polling(sqlite_url: str, tmp_path: Path) -> None:
    store = Store.open(sqlite_url, tmp_path / "audit.spool", SECRET, "signing-key", 5)
    listener = changes.ChangeListener(store.engine, lambda: None).start()
    assert listener._thread is None and not listener.listening  # nothing to listen to
    listener.stop()
    store.close()
