"""The SQLite database holds key hashes and audit: its file is private (0600) like all state."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from tenancy.db import make_engine
from tests.support.cli import Cli


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """The usual umask, under which SQLite alone would create the file 0644."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("permissive_umask")
def test_a_new_sqlite_database_file_and_its_write_ahead_log_are_private(tmp_path: Path) -> None:
    database = tmp_path / "state" / "prefixgate.db"
    engine = make_engine(f"sqlite:///{database}")
    assert mode_of(database) == 0o600 and mode_of(database.parent) == 0o700
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE notes (body TEXT)"))
        connection.execute(text("INSERT INTO notes VALUES ('secret')"))
        for log in ("prefixgate.db-wal", "prefixgate.db-shm"):  # open while we write
            assert mode_of(database.with_name(log)) == 0o600
    engine.dispose()
    assert mode_of(database) == 0o600


@pytest.mark.usefixtures("permissive_umask")
def test_an_existing_sqlite_database_file_keeps_its_mode_and_contents(tmp_path: Path) -> None:
    database = tmp_path / "prefixgate.db"
    first = make_engine(f"sqlite:///{database}")
    with first.begin() as connection:
        connection.execute(text("CREATE TABLE notes (body TEXT)"))
        connection.execute(text("INSERT INTO notes VALUES ('kept')"))
    first.dispose()
    database.chmod(0o640)  # the operator's choice for a file that already exists
    second = make_engine(f"sqlite:///{database}")
    with second.connect() as connection:
        assert connection.execute(text("SELECT body FROM notes")).scalar_one() == "kept"
    second.dispose()
    assert mode_of(database) == 0o640


@pytest.mark.usefixtures("permissive_umask")
def test_the_cli_creates_the_state_database_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    database = state / "prefixgate.db"
    cli = Cli(f"sqlite:///{database}", state)
    cli.ok("db", "upgrade")
    cli.ok("tenants", "create", "acme")
    assert mode_of(database) == 0o600
