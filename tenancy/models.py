"""SQLAlchemy models: tenants, API keys, operators (their sessions and failed logins), public
prefixes, the data keys that seal their second-tier KV blocks (wrapped), the audit log, and
what the database knows about its deployment (secret fingerprints, the KV pool, the gateways
serving it, a change counter).

Constraint names follow one convention (`NAMING_CONVENTION`) so migrations are static and
reversible on every database. Times are timezone-aware UTC. Every value written through the
ORM is checked against its column (`check_column_bounds`), so a too-long name is a typed
`InvalidInput` on every database rather than a data error on PostgreSQL only.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy import inspect as inspect_instance
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tenancy.errors import InvalidInput

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TENANT_STATUSES = ("active", "suspended", "deleted")
SHARING_MODES = ("user", "tenant")
KEY_ROLES = ("inference", "tenant-admin")
OPERATOR_ROLES = ("admin", "tenant-admin")
# A tenant's scheduling weight, lowest and highest: against other tenants with work, its share
# of the engine's service is in proportion to it.
SCHEDULING_WEIGHT_RANGE = (0.01, 100.0)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A moment, always in UTC: aware values are converted to UTC on the way in (SQLite
    would store and compare them as wall-clock time, dropping their offset), and come back
    aware on every database (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is None:  # naive values are UTC by convention
            return value
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint(_one_of("status", TENANT_STATUSES), name="status"),
        CheckConstraint(_one_of("sharing_mode", SHARING_MODES), name="sharing_mode"),
        CheckConstraint("cache_quota_blocks >= 0", name="quota_not_negative"),
        CheckConstraint(
            "cache_reservation_blocks >= 0 AND cache_reservation_blocks <= cache_quota_blocks",
            name="reservation_within_quota",
        ),
        CheckConstraint(
            "requests_per_minute >= 0 AND tokens_per_minute >= 0 AND max_concurrent >= 0",
            name="limits_not_negative",
        ),
        CheckConstraint(
            "scheduling_weight >= {} AND scheduling_weight <= {}".format(*SCHEDULING_WEIGHT_RANGE),
            name="scheduling_weight_range",
        ),
        CheckConstraint(
            "(tier_quota_bytes IS NULL OR tier_quota_bytes >= 0) AND "
            "(tier_reservation_bytes IS NULL OR tier_reservation_bytes >= 0)",
            name="tier_quota_not_negative",
        ),
        CheckConstraint(
            "tier_quota_bytes IS NULL OR tier_reservation_bytes IS NULL OR "
            "tier_reservation_bytes <= tier_quota_bytes",
            name="tier_reservation_within_quota",
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    slug: Mapped[str] = mapped_column(String(63), unique=True)
    display_name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="active")
    sharing_mode: Mapped[str] = mapped_column(String(16), default="user")
    may_use_public_prefixes: Mapped[bool] = mapped_column(Boolean, default=True)
    cache_quota_blocks: Mapped[int] = mapped_column(Integer, default=1024)
    cache_reservation_blocks: Mapped[int] = mapped_column(Integer, default=0)
    requests_per_minute: Mapped[int] = mapped_column(Integer, default=600)
    tokens_per_minute: Mapped[int] = mapped_column(Integer, default=1_000_000)
    max_concurrent: Mapped[int] = mapped_column(Integer, default=16)
    scheduling_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")
    # The tenant's budget in the second KV tier, in bytes. NULL is the default: for the quota
    # the pool quota's bytes (cache_quota_blocks x the bytes of a block of the engine's model,
    # which the engine resolves), for the reservation none (0), as in the pool.
    tier_quota_bytes: Mapped[int | None] = mapped_column(BigInteger)
    tier_reservation_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_one_of("role", KEY_ROLES), name="role"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    # HMAC-SHA256 of the secret under the server's key-hashing secret; never the secret.
    secret_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16), default="inference")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rotated_from_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL")
    )
    # After a rotation the old key keeps working until this time.
    grace_until: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Admin(Base):
    """An operator account: an `admin` runs every tenant, a `tenant-admin` only its own."""

    __tablename__ = "admins"
    __table_args__ = (
        CheckConstraint(_one_of("role", OPERATOR_ROLES), name="role"),
        CheckConstraint(
            "(role = 'admin' AND tenant_id IS NULL) OR "
            "(role = 'tenant-admin' AND tenant_id IS NOT NULL)",
            name="tenant_matches_role",
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    username: Mapped[str] = mapped_column(String(100), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16), default="admin")
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    password_changed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The TOTP second factor (tenancy/totp.py), encrypted (Fernet) under a key derived from the
    # deployment's key-hashing secret: a database dump alone does not give it away. `pending`
    # holds a secret whose enrolment is not confirmed yet; `last_step` is the time step of the
    # last code accepted, so that no code is accepted twice.
    totp_secret: Mapped[str | None] = mapped_column(String(255))
    totp_pending_secret: Mapped[str | None] = mapped_column(String(255))
    totp_last_step: Mapped[int | None] = mapped_column(BigInteger)
    totp_enabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AdminLoginFailure(Base):
    """Failed logins of one (operator name as typed, source address) pair
    (tenancy/login_failures.py); keyed by a digest, so it holds neither names nor addresses."""

    __tablename__ = "admin_login_failures"
    # 0: a pair being checked now, its row locked (tenancy/login_failures.py).
    __table_args__ = (CheckConstraint("failures >= 0", name="failures_not_negative"),)

    pair: Mapped[str] = mapped_column(String(64), primary_key=True)
    failures: Mapped[int] = mapped_column(Integer)
    last_failed_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class AdminSession(Base):
    """One issued admin token (by its JWT id): a logout or a disabled account revokes it."""

    __tablename__ = "admin_sessions"

    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    admin_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("admins.id", ondelete="CASCADE"), index=True
    )
    issued_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class PublicPrefix(Base):
    __tablename__ = "public_prefixes"
    __table_args__ = (UniqueConstraint("model", "namespace", "name"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    namespace: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)


class WrappedDataKey(Base):
    """The data key of a tenant or a public prefix (tenancy/seal_keys.py), stored only wrapped:
    AES-256-GCM under the deployment's master key, bound to its subject and key id."""

    __tablename__ = "seal_keys"

    # `tenant:<uuid>` or `prefix:<uuid>`: one key per owner, whichever gateway makes it first.
    subject: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Public: it names the key inside sealed values (`t-<tenant hex[:12]>-<8 random hex>`).
    key_id: Mapped[str] = mapped_column(String(64), unique=True)
    # nonce (12 bytes) || ciphertext of the 32-byte key || tag (16 bytes); never the key.
    wrapped: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AuditEvent(Base):
    """One link of the hash chain: `hash = SHA-256(prev_hash || canonical JSON of the event)`."""

    __tablename__ = "audit_events"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    event_id: Mapped[uuid.UUID] = mapped_column(Uuid, unique=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    actor_type: Mapped[str] = mapped_column(String(32))
    actor_id: Mapped[str | None] = mapped_column(String(200))
    tenant_id: Mapped[str | None] = mapped_column(String(64), index=True)
    action: Mapped[str] = mapped_column(String(100))
    resource_type: Mapped[str | None] = mapped_column(String(64))
    resource_id: Mapped[str | None] = mapped_column(String(200))
    outcome: Mapped[str] = mapped_column(String(32))
    request_id: Mapped[str | None] = mapped_column(String(100))
    source_ip: Mapped[str | None] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class AuditHead(Base):
    """The chain's tip, one row, locked while appending so the chain has a single order."""

    __tablename__ = "audit_head"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(64))


class AuditCheckpoint(Base):
    """A signed statement that the chain reached `seq` with `hash`."""

    __tablename__ = "audit_checkpoints"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    hash: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class SecretFingerprint(Base):
    """A keyed fingerprint of a secret the database was set up with; never the secret."""

    __tablename__ = "secret_fingerprints"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Deployment(Base):
    """One row of facts that servers report about the deployment (the KV pool size)."""

    __tablename__ = "deployment"
    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint("pool_blocks IS NULL OR pool_blocks > 0", name="pool_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pool_blocks: Mapped[int | None] = mapped_column(Integer)
    pool_recorded_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class GatewayInstance(Base):
    """A running gateway process, as it last reported itself (every few seconds)."""

    __tablename__ = "gateway_instances"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    # Where it counts tenants' limits: "" in its own process, else a digest naming the shared
    # store (a Redis and a key prefix; never its password).
    limits_store: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class TenancyChanges(Base):
    """One row whose `seq` grows with every committed change to tenants or API keys."""

    __tablename__ = "tenancy_changes"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)


# The range each integer column type holds on PostgreSQL (SQLite would store anything).
_INTEGER_BITS = ((BigInteger, 64), (SmallInteger, 16), (Integer, 32))


def check_column_bounds(instance: Base, changed_only: bool = False) -> None:
    """Raise `InvalidInput` naming the field if a value does not fit its column.

    Strings are checked against their length, integers against their type's range; with
    `changed_only`, only attributes modified since load are checked.
    """
    state = inspect_instance(instance)
    for column in instance.__table__.columns:
        if changed_only and not state.attrs[column.key].history.has_changes():
            continue
        value = getattr(instance, column.key, None)
        if isinstance(value, str) and isinstance(column.type, String):
            limit = column.type.length
            if limit is not None and len(value) > limit:
                raise InvalidInput(
                    f"{column.key} must be at most {limit} characters (got {len(value)})",
                    column.key,
                )
        elif isinstance(value, int) and not isinstance(value, bool):
            bits = next((b for kind, b in _INTEGER_BITS if isinstance(column.type, kind)), None)
            if bits is not None and not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
                low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
                raise InvalidInput(
                    f"{column.key} must be between {low} and {high} (got {value})", column.key
                )
