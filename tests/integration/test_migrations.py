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
          "audit_checkpoints"}  # fmt: skip


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


def test_upgrade_from_empty_and_downgrade_to_base_on_postgres(empty_postgres_url: str) -> None:
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
