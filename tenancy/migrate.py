"""Alembic, driven from code: upgrade, downgrade, and refusing to run on a stale schema."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from tenancy.db import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


class SchemaOutOfDate(Exception):
    """The database schema is not the one this code needs; the message says how to fix it."""


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema up to `revision` (default: the newest)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def ensure_current(url: str, engine: Engine | None = None) -> None:
    """Raise `SchemaOutOfDate` unless the database is at the newest migration."""
    engine = engine or make_engine(url)
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    where = "without a migration version" if current is None else f"at revision {current}"
    raise SchemaOutOfDate(
        f"the database schema is {where} but this version of PrefixGate needs {head}; "
        "run `prefixgate db upgrade`"
    )
