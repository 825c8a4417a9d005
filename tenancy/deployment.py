"""What the database knows about the deployment it serves: its secrets' fingerprints, its pool,
the gateways serving it.

Secrets (the key-hashing secret, the audit signing key) belong to the deployment. A process
started with other secrets would mint keys the servers reject and sign checkpoints that
verify as forged, so the first process to use a database records a fingerprint of each secret
(`HMAC-SHA256(secret, "prefixgate fingerprint")`, truncated: it identifies the secret without
revealing it) and every later one must match. Servers also record their KV pool size, so quota
and reservation changes can be checked against the memory that will hold them, and every
gateway reports itself every few seconds, so each can tell how many serve the deployment (and
whether they count tenants' limits in one place).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tenancy.errors import InvalidInput, TenancyError
from tenancy.models import Deployment, GatewayInstance, SecretFingerprint, utcnow

FINGERPRINT_MESSAGE = b"prefixgate fingerprint"
FINGERPRINT_LENGTH = 16  # hex characters: 64 bits, plenty to tell two random secrets apart
# A gateway not heard of for this long is gone; its row is deleted.
FORGET_GATEWAY_AFTER = timedelta(days=1)


class SecretMismatch(TenancyError):
    """This process's secrets are not the ones the database was set up with."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


@dataclass(frozen=True, slots=True)
class Pool:
    """The KV pool size a server last recorded, and when."""

    blocks: int
    recorded_at: datetime


def fingerprint(secret: str) -> str:
    """A keyed fingerprint of `secret`: equal secrets match, and it reveals nothing of it."""
    digest = hmac.new(secret.encode(), FINGERPRINT_MESSAGE, hashlib.sha256).hexdigest()
    return digest[:FINGERPRINT_LENGTH]


def mismatched_secrets(sessions: sessionmaker[Session], secrets: Mapping[str, str]) -> list[str]:
    """Names of the secrets whose fingerprint differs from the recorded one; records missing
    ones (first use). A concurrent first use that wins the insert is re-read and compared."""
    try:
        with sessions.begin() as session:
            return _compare_or_record(session, secrets)
    except IntegrityError:  # another process recorded them first: compare with its values
        with sessions.begin() as session:
            return _compare_or_record(session, secrets)


def _compare_or_record(session: Session, secrets: Mapping[str, str]) -> list[str]:
    rows = session.execute(
        select(SecretFingerprint.name, SecretFingerprint.fingerprint).where(
            SecretFingerprint.name.in_(list(secrets))
        )
    )
    recorded = {name: recorded_fingerprint for name, recorded_fingerprint in rows}
    mine = {name: fingerprint(secret) for name, secret in secrets.items()}
    differ = [
        name
        for name in secrets
        if name in recorded and not hmac.compare_digest(recorded[name], mine[name])
    ]
    if not differ:  # a refused process records nothing
        for name in sorted(secrets.keys() - recorded.keys()):
            session.add(SecretFingerprint(name=name, fingerprint=mine[name]))
    return differ


def record_pool_blocks(session: Session, blocks: int) -> None:
    """Remember the KV pool size a server started with (the last one recorded counts)."""
    if blocks <= 0:
        raise InvalidInput("the KV pool must have at least one block", "pool_blocks")
    session.execute(
        update(Deployment)
        .where(Deployment.id == 1)
        .values(pool_blocks=blocks, pool_recorded_at=utcnow())
    )


def recorded_pool(session: Session, for_update: bool = False) -> Pool | None:
    """The pool a server recorded, or None before any did. `for_update` locks the row, so
    concurrent reservation changes are checked one after another."""
    query = select(Deployment.pool_blocks, Deployment.pool_recorded_at).where(Deployment.id == 1)
    if for_update:
        query = query.with_for_update()
    row = session.execute(query).first()
    if row is None or row.pool_blocks is None or row.pool_recorded_at is None:
        return None
    return Pool(row.pool_blocks, row.pool_recorded_at)


@dataclass(frozen=True, slots=True)
class GatewaySeen:
    """A gateway as it last reported itself."""

    id: str
    hostname: str
    pid: int
    limits_store: str  # "": its own process
    seen_at: datetime


def report_gateway(
    session: Session, instance_id: str, hostname: str, pid: int, limits_store: str
) -> None:
    """Record that this gateway runs now (and forget gateways gone for a day)."""
    now = utcnow()
    row = session.get(GatewayInstance, instance_id)
    if row is None:
        session.add(
            GatewayInstance(
                id=instance_id,
                hostname=hostname[:255],
                pid=pid,
                limits_store=limits_store,
                started_at=now,
                seen_at=now,
            )
        )
    else:
        row.seen_at, row.limits_store = now, limits_store
    session.execute(
        delete(GatewayInstance).where(GatewayInstance.seen_at < now - FORGET_GATEWAY_AFTER)
    )


def gateways_seen(session: Session, within: timedelta) -> list[GatewaySeen]:
    """The gateways that reported themselves within `within`, most recent first."""
    rows = session.scalars(
        select(GatewayInstance)
        .where(GatewayInstance.seen_at >= utcnow() - within)
        .order_by(GatewayInstance.seen_at.desc())
    )
    return [GatewaySeen(r.id, r.hostname, r.pid, r.limits_store, r.seen_at) for r in rows]


def forget_gateway(session: Session, instance_id: str) -> None:
    """A gateway that stops says so (one killed is forgotten once it is not seen)."""
    session.execute(delete(GatewayInstance).where(GatewayInstance.id == instance_id))
