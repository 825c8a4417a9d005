"""Database engines and sessions (synchronous SQLAlchemy; callers on an event loop use a
thread pool)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_DATABASE_URL = "sqlite:///./prefixgate.db"


def make_engine(url: str, **options: Any) -> Engine:
    """An engine for `url`; SQLite gets foreign keys on and cross-thread use allowed."""
    if url.startswith("sqlite"):
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
    cursor.close()


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
