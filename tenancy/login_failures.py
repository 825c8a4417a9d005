"""Failed operator logins, counted per (name as typed, source address): a progressive delay
that slows a guesser down without letting anybody lock an account.

A lock on the account would be a weapon: five anonymous wrong passwords would keep its owner
out. Here failures count per *pair*, so a guesser slows only itself: after `free_failures`
failures of one pair, each further attempt of that pair must wait a delay that doubles per
failure (1 s, 2 s, 4 s, ...) up to `max_delay`, while the same name from any other source logs
in at once. A success clears the pair.

Rows are keyed by one HMAC digest over the normalised name and the source, under a deployment
secret: the table holds no names or addresses, and a name that exists is counted exactly like
one that does not (nothing here confirms a name). The database is shared by every gateway, so
the count holds across replicas. A pair is forgotten a day after its last failure, and the
table keeps at most `MAX_ROWS` rows (the pairs with the fewest failures, oldest first, go), so
a flood of made-up names cannot grow it without bound.
"""

from __future__ import annotations

import hashlib
import hmac
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tenancy.models import AdminLoginFailure, utcnow

FORGET_AFTER = timedelta(days=1)
MAX_ROWS = 100_000
_PAIR_CONTEXT = b"prefixgate admin login pair v1\x00"


@dataclass(frozen=True, slots=True)
class LoginDelays:
    """After `free_failures` failures of a pair, each attempt waits 2^(n - free) seconds after
    the last failure (n: the pair's failures), at most `max_delay`."""

    free_failures: int = 5
    max_delay: timedelta = timedelta(minutes=15)

    def after(self, failures: int) -> timedelta:
        """How long a pair with `failures` failures waits after its last one."""
        if failures < self.free_failures:
            return timedelta(0)
        # Capped before it could overflow a timedelta (2**40 s is past any sane max_delay).
        doublings = min(failures - self.free_failures, 40)
        return min(self.max_delay, timedelta(seconds=2**doublings))


def pair_key(secret: str, username: str, source: str | None) -> str:
    """The digest one (name, source) pair is counted under: the name as typed, NFKC and case
    folded (operator names are unique regardless of case), and the source address."""
    name = unicodedata.normalize("NFKC", username).casefold().encode()
    address = (source or "unknown").encode()
    # Length-prefixed, so that no (name, source) split of the same bytes collides.
    message = _PAIR_CONTEXT + len(name).to_bytes(4, "big") + name + address
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def wait_before_attempt(
    session: Session, pair: str, delays: LoginDelays, now: datetime | None = None
) -> timedelta | None:
    """How long this pair must still wait before its next attempt; None if it may try now.

    The pair's row is locked until the transaction ends (made, with no failures, if it has
    none): a second attempt of the same pair, on any gateway, waits until this one has been
    counted, so guesses sent at once cannot all pass the same wait.
    """
    session.execute(
        _dialect_insert(session)(AdminLoginFailure)
        .values(pair=pair, failures=0, last_failed_at=now or utcnow())
        .on_conflict_do_nothing(index_elements=[AdminLoginFailure.pair])
    )
    row = session.get(AdminLoginFailure, pair, with_for_update=True, populate_existing=True)
    now = now or utcnow()  # after the lock: a failure counted while this waited is earlier
    if row is None or row.last_failed_at < now - FORGET_AFTER:
        return None
    if delays.after(row.failures) == timedelta(0):  # still within the free failures
        return None
    allowed_at = row.last_failed_at + delays.after(row.failures)
    return allowed_at - now if allowed_at > now else None


def record_failure(session: Session, pair: str, now: datetime | None = None) -> int:
    """Count one failure of the pair (atomically: failures sent at the same moment each count)
    and forget stale pairs; returns the pair's failures now."""
    now = now or utcnow()
    _forget_stale(session, now)  # so a pair forgotten by age starts again from one
    statement = _dialect_insert(session)(AdminLoginFailure).values(
        pair=pair, failures=1, last_failed_at=now
    )
    counted = statement.on_conflict_do_update(
        index_elements=[AdminLoginFailure.pair],
        set_={"failures": AdminLoginFailure.failures + 1, "last_failed_at": now},
    ).returning(AdminLoginFailure.failures)
    failures: int = session.execute(counted).scalar_one()
    return failures


def _dialect_insert(session: Session) -> Any:
    """The database's INSERT with ON CONFLICT (PostgreSQL's or SQLite's)."""
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def clear(session: Session, pair: str) -> None:
    """Forget the pair's failures (after a success)."""
    session.execute(delete(AdminLoginFailure).where(AdminLoginFailure.pair == pair))


def _forget_stale(session: Session, now: datetime) -> None:
    """Drop pairs idle past FORGET_AFTER, then the least-failed, oldest pairs past MAX_ROWS."""
    session.execute(
        delete(AdminLoginFailure).where(AdminLoginFailure.last_failed_at < now - FORGET_AFTER)
    )
    rows = session.scalar(select(func.count()).select_from(AdminLoginFailure)) or 0
    if rows < MAX_ROWS:
        return
    evicted = (
        select(AdminLoginFailure.pair)
        .order_by(AdminLoginFailure.failures, AdminLoginFailure.last_failed_at)
        .limit(rows - MAX_ROWS + 1)
        .scalar_subquery()
    )
    session.execute(delete(AdminLoginFailure).where(AdminLoginFailure.pair.in_(evicted)))
