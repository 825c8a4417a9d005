"""The audit chain's verification status, as admins see it: cached, one check at a time.

Verifying the chain reads every event, so its status is cached per store for
`VERIFICATION_TTL_S` seconds, and callers arriving during a check wait for its result instead
of starting their own: at most one full read of the chain per interval, however many consoles
poll it. (An incremental check would miss an edit to an event it had already passed.)
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import BaseModel, Field
from sqlalchemy import select

from gateway.admin.callers import AdminCaller
from gateway.state import GatewayState
from tenancy.audit_files import UnreadableAuditFile
from tenancy.audit_verification import verify_database
from tenancy.models import AuditCheckpoint
from tenancy.store import Store

VERIFICATION_TTL_S = 10.0


class VerificationOut(BaseModel):
    ok: bool
    events: int = Field(description="Events checked (up to the first problem)")
    problem: str | None
    last_checkpoint_seq: int | None
    last_checkpoint_time: datetime | None
    checked_at: datetime = Field(description=f"Results are reused for {VERIFICATION_TTL_S:g} s")


def chain_status(state: GatewayState, caller: AdminCaller) -> VerificationOut:
    """The chain's verification status, at most VERIFICATION_TTL_S old (admins only)."""
    caller.require_admin()
    return _verifications.get(state.store, lambda: _verify(state))


def _verify(state: GatewayState) -> VerificationOut:
    store = state.store
    with store.transaction() as session:
        try:
            result = verify_database(session, store.signing_key, store.audit.checkpoint_path)
            ok, events, problem = result.ok, result.events, result.problem
        except UnreadableAuditFile as error:
            ok, events, problem = False, 0, f"the chain was not checked: {error}"
        last = session.execute(
            select(AuditCheckpoint.seq, AuditCheckpoint.created_at)
            .order_by(AuditCheckpoint.seq.desc())
            .limit(1)
        ).first()
    return VerificationOut(
        ok=ok,
        events=events,
        problem=problem,
        last_checkpoint_seq=None if last is None else last.seq,
        last_checkpoint_time=None if last is None else last.created_at,
        checked_at=datetime.now(UTC),
    )


class _VerificationCache:
    """Each store's last verification, reused for `ttl_s` seconds; one check at a time."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        # id(store) -> (the store, weakly: ids are reused), when it was checked, the result
        self._entries: dict[int, tuple[weakref.ref[Store], float, VerificationOut]] = {}

    def get(self, store: Store, check: Callable[[], VerificationOut]) -> VerificationOut:
        # Holding the lock while checking makes concurrent callers share one check.
        with self._lock:
            entry = self._entries.get(id(store))
            if (
                entry is not None
                and entry[0]() is store
                and time.monotonic() - entry[1] < self._ttl_s
            ):
                return entry[2]
            result = check()
            self._entries = {
                key: kept for key, kept in self._entries.items() if kept[0]() is not None
            }
            self._entries[id(store)] = (weakref.ref(store), time.monotonic(), result)
            return result


_verifications = _VerificationCache(VERIFICATION_TTL_S)
