"""The admin API's JSON: request bodies (strict, no unknown fields) and what it answers.

Cache sizes are shown three ways, because operators think in different units: KV blocks (what
the engine counts), tokens (blocks x block size) and bytes (what the quota costs in memory for
the served model). Second-tier quotas are in bytes only (a tier holds blocks of any model);
null is the default: the pool quota's bytes, and no reservation.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.cache.stats import OwnerStats
from tenancy.models import SCHEDULING_WEIGHT_RANGE
from tenancy.tenants import MAX_TIER_BYTES

_ISO_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]")


def _iso_only(value: object) -> object:
    """Pydantic would read "2766" (or 2766) as seconds since 1970; a time here is ISO 8601 or
    nothing."""
    if not isinstance(value, str | datetime) or (
        isinstance(value, str) and not _ISO_DATE_TIME.match(value)
    ):
        raise ValueError("expected an ISO 8601 date-time with a time zone")
    return value


def _in_utc(value: datetime) -> datetime:
    """The same instant in UTC (databases compare stored UTC times), between 1970 and 9000
    so that ranges computed from it stay representable."""
    if not 1970 <= value.year <= 9000:
        raise ValueError("expected a time between the years 1970 and 9000")
    return value.astimezone(UTC)


# A point in time from a query string or a body: ISO 8601 with a time zone
# (2026-11-30T12:00:00Z), handed on in UTC.
IsoTime = Annotated[AwareDatetime, BeforeValidator(_iso_only), AfterValidator(_in_utc)]


def _utc_named(value: object) -> object:
    """A time as the console writes it ("2030-01-31 23:59:59 UTC") is ISO 8601 in UTC."""
    if isinstance(value, str) and value.strip().upper().endswith("UTC"):
        return value.strip()[:-3].strip() + "Z"
    return value


def _utc_if_naive(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# A time a person typed (the console's UTC fields): as IsoTime, but written the way the
# console shows times ("... UTC"), or without a zone, which is UTC. Before-validators run last
# to first: the UTC suffix goes before the ISO check.
TypedTime = Annotated[
    datetime,
    BeforeValidator(_iso_only),
    BeforeValidator(_utc_named),
    AfterValidator(_utc_if_naive),
    AfterValidator(_in_utc),
]
Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Limit = Annotated[int, Field(ge=0, le=2**31 - 1)]
Blocks = Annotated[int, Field(ge=0, le=2**31 - 1)]
TierBytes = Annotated[int, Field(ge=0, le=MAX_TIER_BYTES)]
TIER_QUOTA_HELP = (
    "Bytes the tenant may keep in the second KV tier; null: the default, its pool quota's "
    "bytes (the quota in blocks x the bytes of a block of the model)"
)
TIER_RESERVATION_HELP = (
    "Bytes of the tenant's in the second KV tier that no other tenant's blocks can evict, at "
    "most the tier quota; null: the default, none"
)
SchedulingWeight = Annotated[
    float,
    Field(
        ge=SCHEDULING_WEIGHT_RANGE[0],
        le=SCHEDULING_WEIGHT_RANGE[1],
        allow_inf_nan=False,
        description="Against other tenants with work, the tenant's share of the engine's "
        "service is in proportion to it; equal weights share equally",
    ),
]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- requests ---------------------------------------------------------------------------------


TotpCode = Annotated[str, StringConstraints(min_length=1, max_length=16)]


class LoginBody(Body):
    username: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    password: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    totp_code: TotpCode | None = Field(
        default=None, description="The one-time code, for an operator with a second factor"
    )


class TotpConfirm(Body):
    password: Annotated[str, StringConstraints(min_length=1, max_length=1024)] = Field(
        description="The account's password: a session alone cannot add a second factor"
    )
    code: TotpCode = Field(description="The code the authenticator app shows now")


class TotpDisable(Body):
    password: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    code: TotpCode = Field(description="The code the authenticator app shows now")


class TenantCreate(Body):
    slug: Annotated[str, StringConstraints(min_length=1, max_length=63)]
    display_name: Name | None = None
    sharing_mode: Literal["user", "tenant"] = "user"
    may_use_public_prefixes: bool = True
    cache_quota_blocks: Blocks | None = None
    cache_reservation_blocks: Blocks = 0
    requests_per_minute: Limit = 600
    tokens_per_minute: Limit = 1_000_000
    max_concurrent: Limit = 16
    scheduling_weight: SchedulingWeight = 1.0
    tier_quota_bytes: TierBytes | None = Field(default=None, description=TIER_QUOTA_HELP)
    tier_reservation_bytes: TierBytes | None = Field(
        default=None, description=TIER_RESERVATION_HELP
    )


class TenantUpdate(Body):
    """What to change; a field left out stays as it is."""

    display_name: Name | None = None
    sharing_mode: Literal["user", "tenant"] | None = None
    may_use_public_prefixes: bool | None = None
    requests_per_minute: Limit | None = None
    tokens_per_minute: Limit | None = None
    max_concurrent: Limit | None = None
    scheduling_weight: SchedulingWeight | None = None

    @field_validator("scheduling_weight", mode="before")
    @classmethod
    def _weight_not_null(cls, value: object) -> object:
        """Null is not a weight: a client that sends it meant some weight, not none."""
        if value is None:
            raise PydanticCustomError(
                "null_weight", "null is not a weight: leave it out to keep it"
            )
        return value


class QuotaUpdate(Body):
    """A new quota, reservation or both, each in blocks or in tokens (rounded up to blocks),
    and a new tier quota or tier reservation in bytes: a field left out stays as it is, a tier
    field sent as null goes back to the default."""

    quota_blocks: Blocks | None = None
    quota_tokens: Blocks | None = None
    reservation_blocks: Blocks | None = None
    reservation_tokens: Blocks | None = None
    tier_quota_bytes: TierBytes | None = Field(default=None, description=TIER_QUOTA_HELP)
    tier_reservation_bytes: TierBytes | None = Field(
        default=None, description=TIER_RESERVATION_HELP
    )

    def tier_changes(self) -> dict[str, int | None]:
        """The tier fields this body sets (null included), by name; the others stay."""
        return {
            name: getattr(self, name)
            for name in ("tier_quota_bytes", "tier_reservation_bytes")
            if name in self.model_fields_set
        }


class KeyCreate(Body):
    name: Name
    role: Literal["inference", "tenant-admin"] = "inference"
    # JSON has no datetime or uuid type: these two parse from strings.
    expires_at: IsoTime | None = Field(
        default=None, strict=False, description="ISO 8601 with a time zone"
    )


class KeyRotate(Body):
    grace_seconds: Annotated[int, Field(ge=0, le=30 * 86_400)] = 86_400


class PrefixCreate(Body):
    namespace: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    name: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    text: Annotated[str, StringConstraints(min_length=1, max_length=200_000)]
    model: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="Default: the served model"
    )


class PrefixUpdate(Body):
    enabled: bool


class OperatorCreate(Body):
    username: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    password: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    role: Literal["admin", "tenant-admin"] = "admin"
    tenant_id: uuid.UUID | None = Field(default=None, strict=False)


class OperatorUpdate(Body):
    disabled: bool


class PasswordChange(Body):
    password: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    current_password: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Required to change your own password"
    )


# -- answers ----------------------------------------------------------------------------------


class Amount(BaseModel):
    blocks: int
    tokens: int
    bytes: int


class WorkerCache(BaseModel):
    """One tenant's blocks on one engine worker (the quota holds on each worker)."""

    worker: str
    model: str | None = Field(description="The model it serves (null: not known yet)")
    active_blocks: int
    cached_blocks: int
    quota_blocks: int


def unseen_owner(quota_blocks: int, reserved_blocks: int) -> OwnerStats:
    """The stats of a tenant the engine has not seen yet: nothing held, its own budget."""
    return OwnerStats(0, 0, reserved_blocks=reserved_blocks, quota_blocks=quota_blocks)


class PoolBlocks(BaseModel):
    """One owner's blocks in one model's KV pool now, and its running totals there.

    Behind a routing gateway these are summed over the pool's workers (so is the quota, which
    holds on each).
    """

    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float = Field(
        description="Cached tokens over prompt tokens (the public budget's: of the prompt tokens "
        "in public blocks, those read from cache); 0 without prompts"
    )
    tier_cached_tokens: int = Field(
        0, description="Of the cached tokens, those read back from the second KV tier"
    )
    tier_bytes: int = Field(0, description="Bytes the owner holds in the second KV tier now")
    tier_entries: int = Field(0, description="Blocks the owner holds in the second KV tier now")

    @classmethod
    def of(cls, stats: OwnerStats, **identity: object) -> Self:
        """From the engine's stats of the owner, with the fields that say whose they are."""
        counters = stats.counters
        return cls.model_validate(
            {
                "active_blocks": stats.active_blocks,
                "cached_blocks": stats.cached_blocks,
                "reserved_blocks": stats.reserved_blocks,
                "quota_blocks": stats.quota_blocks,
                "prompt_tokens": counters.prompt_tokens,
                "cached_tokens": counters.cached_tokens,
                "tier_cached_tokens": counters.tier_tokens,
                "hit_ratio": counters.reuse,
                "tier_bytes": stats.tier_bytes,
                "tier_entries": stats.tier_entries,
                **identity,
            }
        )


class PoolUsage(PoolBlocks):
    """One tenant's blocks in the pool of one model (its quota holds in each pool)."""

    model: str


class CacheUsage(PoolBlocks):
    """One tenant's blocks in the engine now, and its running totals since the server started.

    Behind a routing gateway these are summed over the engine workers (so is the quota, which
    holds on each), and `workers` lists each worker's share. `pools` splits the same figures by
    model: a tenant's quota and reservation hold separately in each model's pool.
    """

    evicted_own_blocks: int
    evicted_pressure_blocks: int
    purged_blocks: int
    workers: list[WorkerCache] = []
    pools: list[PoolUsage] = []

    @classmethod
    def of_tenant(
        cls, stats: OwnerStats | None, quota_blocks: int, reserved_blocks: int
    ) -> CacheUsage:
        """From the engine's stats (None: the engine has not seen the tenant yet)."""
        if stats is None:
            stats = unseen_owner(quota_blocks, reserved_blocks)
        counters = stats.counters
        return cls.of(
            stats,
            evicted_own_blocks=counters.evicted_own_blocks,
            evicted_pressure_blocks=counters.evicted_pressure_blocks,
            purged_blocks=counters.purged_blocks,
        )


class TenantOut(BaseModel):
    id: uuid.UUID
    slug: str
    display_name: str
    status: str
    sharing_mode: str
    may_use_public_prefixes: bool
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    scheduling_weight: SchedulingWeight
    created_at: datetime
    quota: Amount
    reservation: Amount
    tier_quota_bytes: int | None = Field(description=TIER_QUOTA_HELP)
    tier_reservation_bytes: int | None = Field(description=TIER_RESERVATION_HELP)
    cache: CacheUsage


class TenantPage(BaseModel):
    data: list[TenantOut]
    total: int
    limit: int
    offset: int


class KeyOut(BaseModel):
    key_id: str
    name: str
    role: str
    state: str  # active, rotating, expired or revoked
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    grace_until: datetime | None


class CreatedKeyOut(KeyOut):
    key: str = Field(description="The full API key: shown this once, never stored")


class PrefixOut(BaseModel):
    id: uuid.UUID
    namespace: str
    name: str
    model: str
    enabled: bool
    created_by: str
    created_at: datetime
    text: str
    tokens: int | None = Field(description="Tokens it shares for the served model (else null)")
    blocks: int | None = Field(description="Whole KV blocks it shares (else null)")
    warning: str | None = None


class OperatorOut(BaseModel):
    id: uuid.UUID
    username: str
    role: str
    tenant_id: uuid.UUID | None
    disabled: bool
    second_factor: bool = Field(description="Whether a TOTP second factor is enrolled")
    created_at: datetime


class TotpEnrolmentOut(BaseModel):
    """A second factor to enrol: show it once, then confirm it with a code from the app."""

    otpauth_uri: str = Field(description="For an authenticator app (as a QR code or pasted)")
    secret: str = Field(description="The same secret, base32, for typing in by hand")


class LoginOut(BaseModel):
    token: str
    token_type: Literal["bearer"] = "bearer"
    expires_at: datetime
    operator: OperatorOut


class CallerOut(BaseModel):
    role: str
    tenant_id: uuid.UUID | None
    actor_type: str
    actor_id: str


class PoolOwner(PoolBlocks):
    """An owner of blocks in one pool: a tenant, or the public budget (shared prefixes)."""

    owner: str = Field(description='The tenant\'s id, or "public" for the public budget')
    tenant_id: uuid.UUID | None = Field(description="Null for the public budget")
    slug: str | None = Field(
        description="The tenant's slug; null for the public budget and for an owner that is "
        "no live tenant (deleted since)"
    )


class PoolWorker(BaseModel):
    """One engine worker as the gateway sees it (admins only: addresses are infrastructure)."""

    url: str
    up: bool = Field(description="In routing now")
    in_flight: int = Field(description="This gateway's requests on it now")
    load: int = Field(description="Sequences in flight there at its last poll (every gateway's)")
    cached_keys: int = Field(description="Block keys it has published to this gateway")
    last_error: str | None = Field(
        description="Why it was last taken out of routing, even if it is back (null: never)"
    )


class PoolOut(BaseModel):
    """One model's KV pool: its workers, its size and each owner's blocks in it."""

    model: str
    served: bool = Field(description="Whether requests for this model are served now")
    total_blocks: int | None = Field(
        description="Blocks of the pool, summed over its workers (null: none answers)"
    )
    free_blocks: int | None = Field(
        description="Blocks free now (null: no worker answers, or the caller is a tenant-admin)"
    )
    workers: list[PoolWorker] | None = Field(
        description="Its engine workers (empty: the engine is in the gateway's process); null "
        "for a tenant-admin"
    )
    owners: list[PoolOwner] = Field(
        description="The public budget first, then the tenants that hold or reserve blocks here "
        "or have sent prompts, by slug; a tenant-admin gets its own tenant's row only"
    )


class PoolsOut(BaseModel):
    """Every model's KV pool this gateway serves from, as the caller may see it."""

    pools: list[PoolOut] = Field(description="By model name")
    workers_without_model: list[PoolWorker] | None = Field(
        description="Workers that have not said which model they serve (none has answered "
        "yet); null for a tenant-admin"
    )
