"""The tenancy change counter: how running gateways learn, within a poll, that something changed.

Every committed change to a tenant (create, quota, reservation, sharing, limits, status,
delete) or an API key (create, revoke, rotate) bumps `tenancy_changes.seq` in the same
transaction. The bump has one home: session listeners that `track` installs on every
sessionmaker `make_sessions` builds, so no repository function can forget it. A key's
`last_used_at`, written on every authentication, is not a change. A gateway polls
`current_seq` (one indexed single-row read) and, when it moved, reads `tenant_budgets`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

from sqlalchemy import event, inspect, select, update
from sqlalchemy.orm import InstanceState, ORMExecuteState, Session, sessionmaker

from tenancy.models import ApiKey, TenancyChanges, Tenant

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
        )
    )
    return {
        str(tenant_id): TenantRow(str(tenant_id), slug, status, quota, reservation)
        for tenant_id, slug, status, quota, reservation in rows
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
    session.connection().execute(
        update(TenancyChanges).where(TenancyChanges.id == 1).values(seq=TenancyChanges.seq + 1)
    )
