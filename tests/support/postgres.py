"""Throwaway PostgreSQL databases on the real server (PREFIXGATE_TEST_POSTGRES)."""

from __future__ import annotations

import os
import uuid

import psycopg
from sqlalchemy.engine import make_url

SERVER_URL = os.environ.get(
    "PREFIXGATE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _connect() -> psycopg.Connection[tuple[object, ...]]:
    url = make_url(SERVER_URL)
    try:
        return psycopg.connect(
            host=url.host, port=url.port or 5432, user=url.username, password=url.password,
            dbname=url.database or "postgres", autocommit=True, connect_timeout=5,
        )  # fmt: skip
    except psycopg.OperationalError as error:
        raise RuntimeError(
            f"no PostgreSQL server at {SERVER_URL} ({error}); .ci/run starts one, or set "
            "PREFIXGATE_TEST_POSTGRES"
        ) from error


def database_url(name: str) -> str:
    return make_url(SERVER_URL).set(database=name).render_as_string(hide_password=False)


def create_database(prefix: str = "prefixgate_test", template: str | None = None) -> str:
    """A new empty (or template-copied) database; returns its name."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _connect() as connection:
        suffix = f" TEMPLATE {template}" if template else ""
        connection.execute(f'CREATE DATABASE "{name}"{suffix}')  # type: ignore[arg-type]
    return name


def drop_database(name: str) -> None:
    with _connect() as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]
