"""The tenancy change feed: a change counter, and the notices that tell running gateways at
once that something changed.

Every committed change to a tenant (create, quota, reservation, sharing, limits, status,
delete) or an API key (create, revoke, rotate) bumps `tenancy_changes.seq` in the same
transaction. The bump has one home: session listeners that `track` installs on every
sessionmaker `make_sessions` builds, so no repository function can forget it. A key's
`last_used_at`, written on every authentication, is not a change. A gateway polls
`current_seq` (one indexed single-row read) and, when it moved, reads `tenant_budgets`: each
tenant's pool quota and reservation (blocks) and its second-tier quota and reservation (bytes;
None is the default, resolved by the engine from the pool's).

On PostgreSQL the bump also sends `NOTIFY prefixgate_tenancy`, which the database delivers
only when the transaction commits, to every gateway that listens (`ChangeListener`): a change
made through any gateway or the CLI reaches every other gateway as it commits, however many
there are. Polling stays, for SQLite and for a listener whose connection broke.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

from sqlalchemy import Engine, event, inspect, select, text, update
from sqlalchemy.orm import InstanceState, ORMExecuteState, Session, sessionmaker

from tenancy.models import ApiKey, TenancyChanges, Tenant

logger = logging.getLogger(__name__)
CHANNEL = "prefixgate_tenancy"
_WATCHED: tuple[type, ...] = (Tenant, ApiKey)
# Written on every successful authentication; counting it would make every request a change.
_NOT_A_CHANGE = frozenset({"last_used_at"})


@dataclass(frozen=True, slots=True)
class TenantRow:
    """What a gateway needs to keep its engine budgets and caches in step with a tenant."""

    tenant_id: str
    slug: str
    status: str
    cache_quota_blocks: int
    cache_reservation_blocks: int
    # Bytes in the second KV tier; None: the default (the quota: the pool quota's bytes,
    # resolved with the engine's bytes per block; the reservation: none).
    tier_quota_bytes: int | None = None
    tier_reservation_bytes: int | None = None


def current_seq(session: Session) -> int:
    """The change counter (0 on a database that never changed)."""
    return session.scalar(select(TenancyChanges.seq).where(TenancyChanges.id == 1)) or 0


def tenant_budgets(session: Session) -> dict[str, TenantRow]:
    """Every tenant by id, deleted ones included (status "deleted"), so pollers see deletions."""
    rows = session.execute(
        select(
            Tenant.id,
            Tenant.slug,
            Tenant.status,
            Tenant.cache_quota_blocks,
            Tenant.cache_reservation_blocks,
            Tenant.tier_quota_bytes,
            Tenant.tier_reservation_bytes,
        )
    )
    return {
        str(row.id): TenantRow(
            str(row.id),
            row.slug,
            row.status,
            row.cache_quota_blocks,
            row.cache_reservation_blocks,
            row.tier_quota_bytes,
            row.tier_reservation_bytes,
        )
        for row in rows
    }


def track(sessions: sessionmaker[Session]) -> None:
    """Make every session from `sessions` bump the counter when it changes tenancy rows."""
    event.listen(sessions, "before_flush", _before_flush)
    event.listen(sessions, "do_orm_execute", _on_bulk_statement)


def _before_flush(session: Session, _context: Any, _instances: Any) -> None:
    pending = chain(session.new, session.dirty, session.deleted)
    if any(_is_change(session, instance) for instance in pending):
        _bump(session)


def _is_change(session: Session, instance: object) -> bool:
    if not isinstance(instance, _WATCHED):
        return False
    if instance in session.new or instance in session.deleted:
        return True
    state: InstanceState[object] = inspect(instance)
    modified = {attr.key for attr in state.attrs if attr.history.has_changes()}
    return bool(modified - _NOT_A_CHANGE)


def _on_bulk_statement(state: ORMExecuteState) -> None:
    """Bulk INSERT/UPDATE/DELETE statements skip the flush; they count all the same."""
    if not (state.is_insert or state.is_update or state.is_delete):
        return
    if any(mapper.class_ in _WATCHED for mapper in state.all_mappers):
        _bump(state.session)


def _bump(session: Session) -> None:
    # Core on the session's connection: no autoflush, no ORM events, same transaction.
    connection = session.connection()
    connection.execute(
        update(TenancyChanges).where(TenancyChanges.id == 1).values(seq=TenancyChanges.seq + 1)
    )
    if connection.dialect.name == "postgresql":  # delivered at commit, once per transaction
        connection.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})


class ChangeListener:
    """Calls `on_change` as soon as another process commits a tenancy change (PostgreSQL's
    LISTEN/NOTIFY, on a connection of its own and a thread of its own); on other databases it
    does nothing, and polling alone keeps gateways in step.

    After (re)connecting it calls `on_change` once, for whatever committed while it did not
    listen. A broken connection is retried every `retry_s`.
    """

    def __init__(self, engine: Engine, on_change: Callable[[], object], retry_s: float = 1.0):
        self._engine = engine
        self._on_change = on_change
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = False

    def start(self) -> ChangeListener:
        if self._engine.dialect.name == "postgresql" and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="prefixgate-tenancy-listener", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._retry_s + 2)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as error:  # the database went away: poll meanwhile, retry
                if self.listening:
                    logger.warning("tenancy changes: listening stopped (%s); retrying", error)
            self.listening = False
            self._stop.wait(self._retry_s)

    def _listen(self) -> None:
        raw = self._engine.raw_connection()
        connection: Any = raw.driver_connection
        raw.detach()  # its own connection, never returned to the pool in LISTEN state
        try:
            connection.autocommit = True
            connection.execute(f"LISTEN {CHANNEL}")
            self.listening = True
            self._notified()
            while not self._stop.is_set():
                # Returns after a second without notifications, to look at the stop flag.
                for _ in connection.notifies(timeout=1.0):
                    self._notified()
                    if self._stop.is_set():
                        break
        finally:
            connection.close()

    def _notified(self) -> None:
        try:
            self._on_change()
        except Exception:  # the poll's own failure; the next notification or poll retries
            logger.warning("applying tenancy changes failed", exc_info=True)
