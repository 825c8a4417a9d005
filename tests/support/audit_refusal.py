"""A database that refuses some audit events, as an operator's stricter schema would, and
the fix that lifts it: how real dead letters are made, on PostgreSQL and on SQLite."""

from __future__ import annotations

from sqlalchemy import text

from tenancy.store import Store


def refuse(store: Store, action: str, name: str) -> None:
    """Make the database refuse events with `action`, as an operator's stricter schema would.

    The refusal is named `name`, which its error message carries.
    """
    with store.transaction() as session:
        if store.engine.dialect.name == "sqlite":
            session.execute(
                text(
                    f"CREATE TRIGGER {name} BEFORE INSERT ON audit_events "
                    f"WHEN NEW.action = '{action}' BEGIN SELECT RAISE(ABORT, '{name}'); END"
                )
            )
        else:
            session.execute(
                text(f"ALTER TABLE audit_events ADD CONSTRAINT {name} CHECK (action <> '{action}')")
            )


def fix(store: Store, name: str) -> None:
    """Lift the refusal `name`: the fix a replay follows."""
    with store.transaction() as session:
        if store.engine.dialect.name == "sqlite":
            session.execute(text(f"DROP TRIGGER {name}"))
        else:
            session.execute(text(f"ALTER TABLE audit_events DROP CONSTRAINT {name}"))
