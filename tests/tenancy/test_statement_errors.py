"""A failed statement's error, which goes to the server's log, never holds its bound values:
a key's hash, a TOTP secret or a tenant's data (an attacker's trial found part of a key's hash
in the log of a refused insert)."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from tenancy.db import make_engine

SECRET = "bound-value-never-logged"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_failed_statement_names_no_bound_value(backend: str, postgres_url: str) -> None:
    engine = make_engine("sqlite://" if backend == "sqlite" else postgres_url)
    try:
        with engine.connect() as connection, pytest.raises(DBAPIError) as failed:
            connection.execute(text("SELECT * FROM no_such_table WHERE a = :a"), {"a": SECRET})
    finally:
        engine.dispose()
    assert "no_such_table" in str(failed.value)  # the statement is still there to read
    assert SECRET not in str(failed.value)
