"""`prefixgate tenants|keys|admins|db` end to end through the real console script."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from tenancy import api_keys, prefixes
from tenancy.api_keys import VerifiedKey
from tenancy.migrate import head_revision
from tenancy.models import AuditEvent, WrappedDataKey
from tenancy.seal_keys import DataKeyShredded, prefix_data_key, tenant_data_key
from tenancy.store import Store
from tests.support.cli import Cli

MASTER_KEY = bytes(range(32))  # data keys here are made by the test, not by the CLI


def test_tenant_commands_change_the_tenant_and_print_it_as_json(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    created = cli.json("tenants", "create", "acme", "--name", "Acme Corp", "--quota", "64")
    assert (created["slug"], created["display_name"], created["cache_quota_blocks"]) == (
        "acme",
        "Acme Corp",
        64,
    )
    cli.ok("tenants", "create", "globex", "--sharing", "tenant")
    assert [t["slug"] for t in cli.json("tenants", "list")] == ["acme", "globex"]
    updated = cli.json("tenants", "set-quota", "acme", "--quota", "32", "--reservation", "8")
    assert (updated["cache_quota_blocks"], updated["cache_reservation_blocks"]) == (32, 8)
    assert cli.json("tenants", "set-sharing", "acme", "tenant")["sharing_mode"] == "tenant"
    cli.ok("tenants", "suspend", "acme")
    assert cli.json("tenants", "show", "acme")["status"] == "suspended"
    cli.ok("tenants", "delete", "globex")
    assert [t["slug"] for t in cli.json("tenants", "list")] == ["acme"]
    assert "globex" in cli.ok("tenants", "list", "--all")


def test_key_commands_authenticate_until_revoked_never_list_secrets_and_are_audited(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    created = cli.json("keys", "create", "--tenant", "acme", "--name", "ci")
    assert created["key"].startswith(f"pgk_{created['key_id']}_")
    rotated = cli.json("keys", "rotate", "--tenant", "acme", created["key_id"], "--grace", "1h")
    listed = {row["key_id"]: row for row in cli.json("keys", "list", "--tenant", "acme")}
    assert set(listed) == {created["key_id"], rotated["key_id"]}
    assert listed[created["key_id"]]["grace_until"] is not None
    assert "key" not in listed[created["key_id"]]  # secrets are never listed
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "s", 100)
    with store.transaction() as session:
        principal = api_keys.authenticate(session, rotated["key"], store.key_secret)
        assert isinstance(principal, VerifiedKey) and principal.tenant_slug == "acme"
    cli.ok("keys", "revoke", "--tenant", "acme", rotated["key_id"])
    with store.transaction() as session:
        assert not isinstance(
            api_keys.authenticate(session, rotated["key"], store.key_secret), VerifiedKey
        )
        actions = [e.action for e in session.scalars(select(AuditEvent).order_by(AuditEvent.seq))]
    store.close()
    assert actions == ["tenant.create", "api_key.create", "api_key.rotate", "api_key.revoke"]


def test_scheduling_weight_is_set_at_creation_or_later_listed_and_audited(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    assert cli.json("tenants", "create", "acme")["scheduling_weight"] == 1.0
    created = cli.json("tenants", "create", "globex", "--scheduling-weight", "2.5")
    assert created["scheduling_weight"] == 2.5
    assert cli.ok("tenants", "set-weight", "acme", "0.5") == "acme: scheduling weight 0.5\n"
    assert cli.json("tenants", "show", "acme")["scheduling_weight"] == 0.5
    assert "scheduling_weight          0.5" in cli.ok("tenants", "show", "acme")
    lines = cli.ok("tenants", "list").splitlines()
    assert [line.split()[-1] for line in lines] == ["weight=0.5", "weight=2.5"]
    line = cli.error("tenants", "set-weight", "acme", "0.001")
    assert line == "prefixgate: error: scheduling weight must be between 0.01 and 100 (got 0.001)"
    assert cli.json("tenants", "show", "acme")["scheduling_weight"] == 0.5
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "s", 100)
    with store.transaction() as session:
        query = (
            select(AuditEvent)
            .where(AuditEvent.action == "tenant.set_weight")
            .order_by(AuditEvent.seq)
        )
        events = [(e.outcome, e.details["scheduling_weight"]) for e in session.scalars(query)]
    store.close()
    assert events == [("success", 0.5), ("failure", 0.001)]


def test_a_weight_is_a_plain_decimal_shown_exactly(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme", "--scheduling-weight", "1e1")
    assert cli.json("tenants", "show", "acme")["scheduling_weight"] == 10.0
    said = cli.ok("tenants", "set-weight", "acme", "0.1234567")
    assert said == "acme: scheduling weight 0.1234567\n"  # not rounded to 0.123457
    assert cli.ok("tenants", "list").split()[-1] == "weight=0.1234567"
    assert cli.ok("tenants", "set-weight", "acme", ".5") == "acme: scheduling weight 0.5\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenants", "show", "nope"], "no tenant 'nope'"),
        (["tenants", "create", "acme"], "a tenant with slug 'acme' already exists"),
        (["tenants", "create", "Bad Slug!"], "invalid tenant slug 'Bad Slug!'"),
        (["tenants", "set-quota", "acme", "--quota", "-5"], "cache quota must not be negative"),
        (["tenants", "set-quota", "acme", "--quota", "4", "--reservation", "9"],
         "cache reservation (9) must not exceed the quota (4)"),
        (["tenants", "set-sharing", "acme", "everyone"], "sharing mode must be one of"),
        (["keys", "create", "--tenant", "nope"], "no tenant 'nope'"),
        (["keys", "revoke", "--tenant", "acme", "zzzzzzzzzzzz"], "no key 'zzzzzzzzzzzz'"),
        (["keys", "rotate", "--tenant", "acme", "x", "--grace", "soon"], "--grace: expected"),
        (["audit", "export", "--out", "/nonexistent/dir/a.jsonl"], "cannot write"),
        # The year 10000 in UTC: out of range (was "unexpected InvalidInput", exit 1).
        (["audit", "export", "--out", "a.jsonl", "--since", "9999-12-31T23:59:59-05:00"],
         "since is out of range"),
    ],
)  # fmt: skip
def test_bad_input_gets_one_line_and_a_non_zero_exit(
    args: list[str], message: str, postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    line = cli.error(*args)
    assert line.startswith("prefixgate: error: ") and message in line, line


def test_admins_create_reads_the_password_from_stdin(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    assert "created admin ops" in cli.ok("admins", "create", "ops", stdin="correct horse battery\n")
    created = json.loads(cli.ok("admins", "create", "ops2", "--json", stdin="another long pass\n"))
    assert (created["username"], created["role"]) == ("ops2", "admin")
    assert "at least 12 characters" in cli.error("admins", "create", "ops3", stdin="short\n")
    assert "already exists" in cli.error("admins", "create", "ops", stdin="another long pass\n")


def test_a_new_sqlite_database_is_refused_until_db_upgrade_then_used(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'prefixgate.db'}"
    cli = Cli(url, tmp_path / "state")
    line = cli.error("tenants", "list")
    assert "run `prefixgate db upgrade`" in line
    assert f"database schema at {head_revision()}" in cli.ok("db", "upgrade")
    cli.ok("tenants", "create", "local")
    assert cli.json("tenants", "list")[0]["slug"] == "local"


def test_serve_refuses_a_schema_that_is_behind_in_one_line(tmp_path: Path) -> None:
    from alembic.command import stamp
    from sqlalchemy import text

    from tenancy.db import make_engine
    from tenancy.migrate import alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    with engine.begin() as connection:  # a database from some other (older) revision
        connection.execute(text("CREATE TABLE tenants (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    stamp(alembic_config(url), "base")
    cli = Cli(url, tmp_path / "state")
    line = cli.error("serve", "--port", "0")
    assert "run `prefixgate db upgrade`" in line


def test_a_refused_change_is_audited_with_the_tenant_it_was_about(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    acme = cli.json("tenants", "create", "acme")["id"]
    cli.ok("tenants", "create", "gone")
    cli.ok("tenants", "delete", "gone")
    refusals = [
        ["tenants", "create", "acme"],  # the slug is taken: by acme
        ["tenants", "set-quota", "acme", "--quota", "-5"],
        ["tenants", "set-weight", "acme", "100.5"],
        ["tenants", "set-sharing", "acme", "everyone"],
        ["keys", "create", "--tenant", "acme", "--name", "n" * 201],
        ["keys", "revoke", "--tenant", "acme", "no-such-key"],
        ["keys", "rotate", "--tenant", "acme", "no-such-key"],
        ["tenants", "suspend", "gone"],  # deleted, yet its id is known
        ["keys", "create", "--tenant", "nobody"],  # no such tenant: no id to give
    ]
    for args in refusals:
        cli.error(*args)
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "s", 100)
    with store.transaction() as session:
        deleted = select(AuditEvent.tenant_id).where(AuditEvent.action == "tenant.delete")
        gone = session.scalar(deleted)
        failures = [
            (event.action, event.tenant_id)
            for event in session.scalars(
                select(AuditEvent).where(AuditEvent.outcome == "failure").order_by(AuditEvent.seq)
            )
        ]
    store.close()
    assert failures == [
        ("tenant.create", acme),
        ("tenant.set_quota", acme),
        ("tenant.set_weight", acme),
        ("tenant.set_sharing", acme),
        ("api_key.create", acme),
        ("api_key.revoke", acme),
        ("api_key.rotate", acme),
        ("tenant.suspend", gone),
        ("api_key.create", None),
    ]
    assert gone is not None


def test_tier_quotas_are_set_read_and_reset_in_bytes_and_audited(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    created = cli.json("tenants", "create", "acme", "--tier-quota-bytes", "2GiB")
    assert (created["tier_quota_bytes"], created["tier_reservation_bytes"]) == (2 << 30, None)
    said = cli.ok("tenants", "set-quota", "acme", "--tier-reservation-bytes", "536870912")
    assert said.splitlines()[0] == (
        "acme: quota 1024, reserved 0, tier quota 2147483648 bytes, tier reserved 536870912 bytes"
    )
    line = cli.error("tenants", "set-quota", "acme", "--tier-quota-bytes", "256MiB")
    assert line.endswith(
        "tier reservation (536870912 bytes) must not exceed the tier quota (268435456 bytes)"
    )
    assert "expected bytes (536870912 or 512MiB) or default" in cli.error(
        "tenants", "set-quota", "acme", "--tier-quota-bytes", "-5"
    )
    reset = cli.json("tenants", "set-quota", "acme", "--tier-quota-bytes", "default")
    assert (reset["tier_quota_bytes"], reset["tier_reservation_bytes"]) == (None, 536870912)
    assert "tier_quota_bytes           default" in cli.ok("tenants", "show", "acme")
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "s", 100)
    with store.transaction() as session:
        query = select(AuditEvent).where(
            AuditEvent.action.in_(["tenant.create", "tenant.set_quota"])
        )
        events = [
            (e.action, e.outcome, e.details.get("tier_quota_bytes", "-"))
            for e in session.scalars(query.order_by(AuditEvent.seq))
        ]
    store.close()
    assert events == [
        ("tenant.create", "success", 2 << 30),
        ("tenant.set_quota", "success", "-"),  # the reservation alone
        ("tenant.set_quota", "failure", 256 << 20),
        ("tenant.set_quota", "success", None),  # back to the default
    ]


def test_deleting_a_tenant_or_prefix_shreds_its_data_key_and_the_event_says_so(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    keyed = uuid.UUID(cli.json("tenants", "create", "keyed")["id"])
    cli.ok("tenants", "create", "unkeyed")
    text = tmp_path / "system.txt"
    text.write_text("You are a helpful assistant for every tenant.\n")
    where = ["--model", "m", "--namespace", "default", "--name", "shared"]
    cli.ok("prefixes", "add", *where, "--text-file", str(text))
    store = Store.open(postgres_url, tmp_path / "spool", "cli-key-secret", "s", 100)
    try:
        with store.transaction() as session:
            tenant_data_key(session, MASTER_KEY, keyed)
            prefix = prefixes.get_prefix(session, "m", "default", "shared")
            prefix_data_key(session, MASTER_KEY, prefix.id)
        cli.ok("tenants", "delete", "keyed")
        cli.ok("tenants", "delete", "unkeyed")
        cli.ok("prefixes", "delete", *where)
        with store.transaction() as session:
            deletions = [
                (e.action, e.resource_id, e.details["data_key_shredded"])
                for e in session.scalars(
                    select(AuditEvent)
                    .where(AuditEvent.action.in_(["tenant.delete", "prefix.delete"]))
                    .order_by(AuditEvent.seq)
                )
            ]
            assert session.scalars(select(WrappedDataKey)).all() == []
            with pytest.raises(DataKeyShredded):
                tenant_data_key(session, MASTER_KEY, keyed)
    finally:
        store.close()
    assert deletions == [
        ("tenant.delete", "keyed", True),
        ("tenant.delete", "unkeyed", False),
        ("prefix.delete", "m/default/shared", True),
    ]
