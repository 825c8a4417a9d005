"""Database engines and sessions (synchronous SQLAlchemy; callers on an event loop use a
thread pool).

Only SQLite and PostgreSQL are supported; `check_database_url` says so in one sentence before
anything tries to connect. Sessions check every value against its column before it is written
and count tenancy changes (`tenancy.change_feed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from tenancy import change_feed
from tenancy.models import Base, check_column_bounds
from tenancy.private_paths import create_private_file

SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_EXAMPLES = "sqlite:////path/to/prefixgate.db or postgresql+psycopg://user:password@host/db"


class UnsupportedDatabase(ValueError):
    """A database URL PrefixGate cannot use; the message says why (never echoing the URL)."""


def check_database_url(url: str) -> str:
    """`url` if PrefixGate can use it: parseable, SQLite or PostgreSQL, driver installed."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UnsupportedDatabase(f"not a database URL; expected e.g. {_EXAMPLES}") from None
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise UnsupportedDatabase(f"{backend} is not supported; use {_EXAMPLES}")
    try:
        parsed.get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError):
        raise UnsupportedDatabase(
            f"the database driver {parsed.drivername!r} is not installed; use {_EXAMPLES}"
        ) from None
    return url


def make_engine(url: str, **options: Any) -> Engine:
    """An engine for `url`; SQLite gets foreign keys on, cross-thread use allowed, and its
    file (mode 0600) and the file's directory (mode 0700) created on first use.

    A failed statement's error never holds its bound values (`hide_parameters`): they can be
    a key's hash, a TOTP secret or a tenant's data, and the error goes to the server's log."""
    check_database_url(url)
    options.setdefault("hide_parameters", True)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:" and not database.startswith("file:"):
            # SQLite would create it with the umask's mode (usually 0644), and gives its journal
            # and WAL files the database file's mode: this keeps them all private too.
            create_private_file(Path(database))
        options.setdefault("connect_args", {"check_same_thread": False})
        engine = create_engine(url, **options)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    options.setdefault("pool_pre_ping", True)
    options.setdefault("connect_args", {"connect_timeout": 5})
    return create_engine(url, **options)


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    # Readers (key checks, exports) and the one writer do not block each other in WAL mode.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    """Sessions that refuse values too large for their columns and count tenancy changes."""
    sessions = sessionmaker(engine, expire_on_commit=False)
    # Registered first, so a refused value raises before the change counter moves.
    event.listen(sessions, "before_flush", _check_bounds)
    change_feed.track(sessions)
    return sessions


def _check_bounds(session: Session, _context: Any, _instances: Any) -> None:
    for instance in (*session.new, *session.dirty):
        if isinstance(instance, Base):
            check_column_bounds(instance, changed_only=instance not in session.new)


def is_outage(error: BaseException) -> bool:
    """Whether the database is unreachable (retry later) rather than refusing this data."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    if isinstance(error, InterfaceError | PoolTimeout):
        return True
    if isinstance(error, OperationalError):
        # SQLSTATE class 54 ("program limit exceeded") is about the statement, not the server.
        sqlstate = getattr(error.orig, "sqlstate", None)
        return not (isinstance(sqlstate, str) and sqlstate.startswith("54"))
    return False
