"""One handle on the tenancy database: sessions, the audit log, the secrets they need."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from tenancy.audit_chain import AuditRecord
from tenancy.audit_log import AuditLog
from tenancy.db import make_engine, make_sessions
from tenancy.migrate import ensure_current


@dataclass
class Store:
    engine: Engine
    sessions: sessionmaker[Session]
    audit: AuditLog
    key_secret: str
    signing_key: str

    @classmethod
    def open(
        cls,
        database_url: str,
        spool_path: Path,
        key_secret: str,
        signing_key: str,
        checkpoint_every: int = 100,
        check_schema: bool = True,
        *,
        checkpoint_path: Path | None = None,
    ) -> Store:
        """Connect; refuses (SchemaOutOfDate) a database whose schema is behind.

        `checkpoint_path` is the append-only file that keeps every signed checkpoint outside
        the database too (None: the database alone holds them).
        """
        engine = make_engine(database_url)
        if check_schema:
            ensure_current(database_url, engine)
        sessions = make_sessions(engine)
        audit = AuditLog(
            sessions, spool_path, signing_key, checkpoint_every, checkpoint_path=checkpoint_path
        )
        return cls(engine, sessions, audit, key_secret, signing_key)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work commits at the end of the block (or rolls back on error)."""
        with self.sessions.begin() as session:
            yield session

    def record(self, record: AuditRecord) -> None:
        self.audit.record(record)

    def close(self) -> None:
        self.engine.dispose()
