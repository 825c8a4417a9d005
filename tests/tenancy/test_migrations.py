"""Alembic migrations on the real PostgreSQL server (and SQLite): up, down, no drift."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from tenancy.db import make_engine
from tenancy.migrate import SchemaOutOfDate, downgrade, ensure_current, head_revision, upgrade
from tenancy.models import Base

TABLES = {"tenants", "api_keys", "admins", "public_prefixes", "audit_events", "audit_head",
          "audit_checkpoints", "secret_fingerprints", "deployment", "tenancy_changes",
          "admin_sessions", "gateway_instances", "admin_login_failures", "seal_keys"}  # fmt: skip


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def schema_drift(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_creates_every_table_and_downgrade_to_base_leaves_none_on_postgres(
    empty_postgres_url: str,
) -> None:
    upgrade(empty_postgres_url)
    assert tables(empty_postgres_url) == TABLES
    ensure_current(empty_postgres_url)
    downgrade(empty_postgres_url, "base")
    assert tables(empty_postgres_url) == set()
    upgrade(empty_postgres_url)  # and back up again: the downgrade left nothing behind
    assert tables(empty_postgres_url) == TABLES


def test_models_match_the_migrated_schema_on_postgres(postgres_url: str) -> None:
    assert schema_drift(postgres_url) == []


def test_models_match_the_migrated_schema_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'drift.db'}"
    upgrade(url)
    assert schema_drift(url) == []
    downgrade(url, "base")
    assert tables(url) == set()


def test_a_schema_that_is_behind_is_refused_with_the_fix(empty_postgres_url: str) -> None:
    with pytest.raises(SchemaOutOfDate, match="run `prefixgate db upgrade`") as raised:
        ensure_current(empty_postgres_url)
    assert "without a migration version" in str(raised.value)
    assert str(head_revision()) in str(raised.value)


def test_0002_adds_deployment_state_to_a_0001_database_and_removes_only_it(
    empty_postgres_url: str,
) -> None:
    from sqlalchemy import text

    upgrade(empty_postgres_url, "0001")
    engine = make_engine(empty_postgres_url)
    try:
        with engine.begin() as connection:  # a tenant made before the upgrade
            connection.execute(text(
                "INSERT INTO tenants VALUES ('00000000-0000-0000-0000-000000000001', 'old', "
                "'Old', 'active', 'user', true, 8, 0, 1, 1, 1, now(), now())"
            ))  # fmt: skip
        upgrade(empty_postgres_url)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT seq FROM tenancy_changes")).all() == [(0,)]
            pool = connection.execute(text("SELECT id, pool_blocks FROM deployment")).all()
            assert pool == [(1, None)]
        downgrade(empty_postgres_url, "0001")
        assert tables(empty_postgres_url) == TABLES - {
            "secret_fingerprints", "deployment", "tenancy_changes", "admin_sessions",
            "gateway_instances", "admin_login_failures", "seal_keys",
        }  # fmt: skip
        with engine.connect() as connection:
            assert connection.execute(text("SELECT slug FROM tenants")).all() == [("old",)]
    finally:
        engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database on each backend the migrations run on."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("empty_postgres_url")
        return url
    return f"sqlite:///{tmp_path / 'old.db'}"


def test_0003_keeps_existing_admins_and_its_downgrade_removes_only_what_it_added(
    empty_database: str,
) -> None:
    from sqlalchemy import text

    url = empty_database
    upgrade(url, "0002")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:  # an operator made before the upgrade
            connection.execute(text(
                "INSERT INTO admins (id, username, password_hash, role, created_at, disabled) "
                "VALUES ('00000000000000000000000000000001', 'old', 'x', 'admin', "
                "CURRENT_TIMESTAMP, false)"
            ))  # fmt: skip
        upgrade(url, "0003")
        with engine.connect() as connection:
            row = connection.execute(
                text("SELECT username, role, failed_logins, tenant_id FROM admins")
            ).all()
            assert row == [("old", "admin", 0, None)]
        downgrade(url, "0002")
        assert "admin_sessions" not in tables(url)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT username FROM admins")).all() == [("old",)]
    finally:
        engine.dispose()


def test_0004_adds_the_gateway_list_and_its_downgrade_removes_only_it(
    empty_postgres_url: str,
) -> None:
    upgrade(empty_postgres_url, "0003")
    assert "gateway_instances" not in tables(empty_postgres_url)
    upgrade(empty_postgres_url)
    assert tables(empty_postgres_url) == TABLES
    assert schema_drift(empty_postgres_url) == []
    downgrade(empty_postgres_url, "0003")
    assert tables(empty_postgres_url) == TABLES - {
        "gateway_instances", "admin_login_failures", "seal_keys",
    }  # fmt: skip


def test_0005_gives_existing_tenants_weight_one_and_its_downgrade_removes_only_the_weight(
    empty_database: str,
) -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    url = empty_database
    upgrade(url, "0004")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:  # a tenant made before the upgrade
            connection.execute(text(
                "INSERT INTO tenants (id, slug, display_name, status, sharing_mode, "
                "may_use_public_prefixes, cache_quota_blocks, cache_reservation_blocks, "
                "requests_per_minute, tokens_per_minute, max_concurrent, created_at, updated_at) "
                "VALUES ('00000000000000000000000000000001', 'old', 'Old', 'active', 'user', "
                "true, 8, 0, 1, 1, 1, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            ))  # fmt: skip
        upgrade(url)
        assert schema_drift(url) == []
        with engine.connect() as connection:
            weights = text("SELECT slug, scheduling_weight FROM tenants")
            assert connection.execute(weights).all() == [("old", 1.0)]
        with pytest.raises(IntegrityError), engine.begin() as connection:
            connection.execute(text("UPDATE tenants SET scheduling_weight = 0"))
        downgrade(url, "0004")
        columns = {column["name"] for column in inspect(engine).get_columns("tenants")}
        assert "scheduling_weight" not in columns and "max_concurrent" in columns
        with engine.connect() as connection:
            assert connection.execute(text("SELECT slug FROM tenants")).all() == [("old",)]
    finally:
        engine.dispose()


def test_0006_drops_the_account_lock_keeps_operators_and_its_downgrade_brings_it_back_empty(
    empty_database: str,
) -> None:
    from sqlalchemy import text

    url = empty_database
    upgrade(url, "0005")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:  # an operator locked before the upgrade
            connection.execute(text(
                "INSERT INTO admins (id, username, password_hash, role, created_at, disabled, "
                "failed_logins, locked_until) VALUES ('00000000000000000000000000000001', "
                "'old', 'x', 'admin', CURRENT_TIMESTAMP, false, 3, CURRENT_TIMESTAMP)"
            ))  # fmt: skip
        upgrade(url)
        assert schema_drift(url) == []
        assert "admin_login_failures" in tables(url)
        with engine.connect() as connection:
            row = connection.execute(text("SELECT username, totp_secret FROM admins")).all()
            assert row == [("old", None)]
        downgrade(url, "0005")
        assert "admin_login_failures" not in tables(url)
        with engine.connect() as connection:
            row = connection.execute(
                text("SELECT username, failed_logins, locked_until FROM admins")
            ).all()
            assert row == [("old", 0, None)]
    finally:
        engine.dispose()


def test_0007_adds_data_keys_and_default_tier_quotas_and_its_downgrade_removes_only_them(
    empty_database: str,
) -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    url = empty_database
    upgrade(url, "0006")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:  # a tenant made before the upgrade
            connection.execute(text(
                "INSERT INTO tenants (id, slug, display_name, status, sharing_mode, "
                "may_use_public_prefixes, cache_quota_blocks, cache_reservation_blocks, "
                "requests_per_minute, tokens_per_minute, max_concurrent, scheduling_weight, "
                "created_at, updated_at) VALUES ('00000000000000000000000000000001', 'old', "
                "'Old', 'active', 'user', true, 8, 0, 1, 1, 1, 2.5, CURRENT_TIMESTAMP, "
                "CURRENT_TIMESTAMP)"
            ))  # fmt: skip
        upgrade(url)
        assert schema_drift(url) == []
        assert "seal_keys" in tables(url)
        with engine.connect() as connection:
            tier = text("SELECT slug, tier_quota_bytes, tier_reservation_bytes FROM tenants")
            assert connection.execute(tier).all() == [("old", None, None)]  # the default
        # Bytes past 32 bits fit; a negative size or a reservation over the quota does not.
        with engine.begin() as connection:
            connection.execute(text(
                "UPDATE tenants SET tier_quota_bytes = 8589934592, tier_reservation_bytes = 1"
            ))  # fmt: skip
        for refused in ("tier_quota_bytes = -1", "tier_reservation_bytes = -1",
                        "tier_reservation_bytes = 8589934593"):  # fmt: skip
            with pytest.raises(IntegrityError), engine.begin() as connection:
                connection.execute(text(f"UPDATE tenants SET {refused}"))
        with engine.begin() as connection:  # a reservation without a quota is the engine's
            connection.execute(text(
                "UPDATE tenants SET tier_quota_bytes = NULL, tier_reservation_bytes = 5"
            ))  # fmt: skip
        with engine.begin() as connection:
            row = "('tenant:x', 'k1', :wrapped, CURRENT_TIMESTAMP)"
            insert = text(
                f"INSERT INTO seal_keys (subject, key_id, wrapped, created_at) VALUES {row}"
            )
            connection.execute(insert, {"wrapped": b"\0" * 60})
        with pytest.raises(IntegrityError), engine.begin() as connection:  # one key a subject
            connection.execute(insert, {"wrapped": b"\1" * 60})
        downgrade(url, "0006")
        assert tables(url) == TABLES - {"seal_keys"}
        columns = {column["name"] for column in inspect(engine).get_columns("tenants")}
        assert not {"tier_quota_bytes", "tier_reservation_bytes"} & columns
        with engine.connect() as connection:
            weights = text("SELECT slug, scheduling_weight FROM tenants")
            assert connection.execute(weights).all() == [("old", 2.5)]
    finally:
        engine.dispose()
