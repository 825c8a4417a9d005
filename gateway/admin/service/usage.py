"""Cache usage and service: each tenant now and over the recent window (its observed share of
the engine's service beside its scheduling weight), and request totals over longer ranges from
the audit log.

Three sources, each for what it knows: the engine's cache stats are the blocks *now* (active,
cached, reserved, quota); the gateway's in-memory `UsageHistory` ring (a sample every
`usage_sample_s`, kept for `usage_window_s`) is the recent past, for charts, the hit ratio and
the share of service of the last minutes; the audit log holds every request ever made, for
totals over days (summed in SQL, at most 90 days at a time). The ring is per process and starts
empty at a restart; the audit log is the record.

A tenant-admin sees its own tenant only: another tenant's id is the same 404 as a missing one.
It gets its own service but not its share of everyone's: its service divided by that share is
every tenant's service, which less its own is what all the others got, over any window it asks.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, Field

from gateway.admin.callers import AdminCaller, visible_tenant, visible_tenants
from gateway.admin.outputs import cache_usage
from gateway.admin.schemas import CacheUsage
from gateway.errors import APIError, from_tenancy_error
from gateway.runtime.usage_history import UsageSample, UsageSummary
from gateway.state import GatewayState
from tenancy import audit_search
from tenancy.errors import TenancyError

DEFAULT_WINDOW_S = 900
DEFAULT_TOTALS_RANGE = timedelta(days=30)


class UsagePoint(BaseModel):
    """One sample of the ring: the tenant's blocks at `time`, and its recent hit ratio."""

    time: datetime
    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    hit_ratio: float | None = Field(
        description="Cached over prompt tokens since the previous point; null without prompts"
    )


class UsageSummaryOut(BaseModel):
    """What the tenant did during the window."""

    prompt_tokens: int
    prefill_tokens_saved: int
    hit_ratio: float
    evicted_own_blocks: int
    evicted_pressure_blocks: int
    requests: int
    errors: int
    service: float = Field(
        description="What the engine computed for it, in prefill-token units (decode tokens "
        "weighted by their measured cost; cached prompt tokens are free)"
    )
    service_share: float | None = Field(
        description="Its service over every tenant's in the window (0 when nothing was "
        "served); against tenants with work, in proportion to the scheduling weights. Null "
        "for a tenant-admin: with its service, it would tell the other tenants' service"
    )


class TenantUsage(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    scheduling_weight: float = Field(description="What its service_share is meant to follow")
    window_s: int
    interval_s: float = Field(description="Seconds between samples")
    cache: CacheUsage = Field(description="The tenant's blocks in the engine now")
    samples: list[UsagePoint] = Field(description="Oldest first")
    summary: UsageSummaryOut


class UsageRow(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    display_name: str
    status: str
    scheduling_weight: float
    cache: CacheUsage = Field(description="The tenant's blocks in the engine now")
    summary: UsageSummaryOut = Field(description="Over the window")


class UsagePage(BaseModel):
    data: list[UsageRow]
    total: int
    limit: int
    offset: int
    window_s: int


class UsageTotals(BaseModel):
    tenant_id: uuid.UUID
    since: datetime
    until: datetime
    requests: int
    errors: int = Field(description="Requests whose outcome was not success")
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_ratio: float


def tenant_usage(
    state: GatewayState, caller: AdminCaller, tenant_id: uuid.UUID, window_s: int
) -> TenantUsage:
    """The tenant's usage now and over the last `window_s` seconds (blocking: database)."""
    with state.store.transaction() as session:
        tenant = visible_tenant(session, caller, tenant_id)
        cache = cache_usage(state, tenant)
        slug, weight = tenant.slug, tenant.scheduling_weight
    window = state.usage.window(str(tenant_id), window_s)
    return TenantUsage(
        tenant_id=tenant_id,
        slug=slug,
        scheduling_weight=weight,
        window_s=window_s,
        interval_s=state.usage.interval_s,
        cache=cache,
        samples=_points(window.samples),
        summary=_summary_out(window.summary, caller),
    )


def usage_table(
    state: GatewayState,
    caller: AdminCaller,
    window_s: int,
    q: str = "",
    limit: int = 50,
    offset: int = 0,
) -> UsagePage:
    """One page of live tenants (a tenant-admin: its own) with their usage (blocking)."""
    with state.store.transaction() as session:
        rows, total = visible_tenants(session, caller, q, limit, offset)
        data = [
            UsageRow(
                tenant_id=tenant.id,
                slug=tenant.slug,
                display_name=tenant.display_name,
                status=tenant.status,
                scheduling_weight=tenant.scheduling_weight,
                cache=cache_usage(state, tenant),
                summary=_summary_out(state.usage.window(str(tenant.id), window_s).summary, caller),
            )
            for tenant in rows
        ]
    return UsagePage(data=data, total=total, limit=limit, offset=offset, window_s=window_s)


def usage_totals(
    state: GatewayState,
    caller: AdminCaller,
    tenant_id: uuid.UUID,
    since: datetime | None = None,
    until: datetime | None = None,
) -> UsageTotals:
    """The tenant's request totals from the audit log (default: the last 30 days; blocking).

    A 400 naming the bound when the default range cannot be computed from `until`.
    """
    end = until or datetime.now(UTC)
    try:
        start = since or end - DEFAULT_TOTALS_RANGE
    except OverflowError:  # until within 30 days of the year 1: no default start exists
        raise APIError.invalid(
            f"until is too early for the default range of {DEFAULT_TOTALS_RANGE.days} days; "
            "give since",
            "until",
        ) from None
    with state.store.transaction() as session:
        visible_tenant(session, caller, tenant_id)
        try:
            totals = audit_search.request_totals(session, str(tenant_id), start, end)
        except TenancyError as error:
            raise from_tenancy_error(error) from error
    return UsageTotals(
        tenant_id=tenant_id,
        since=start,
        until=end,
        hit_ratio=totals.hit_ratio,
        **dataclasses.asdict(totals),
    )


def _points(samples: list[UsageSample]) -> list[UsagePoint]:
    """Chart points; each one's hit ratio covers the requests since the sample before it."""
    points = []
    previous: UsageSample | None = None
    for sample in samples:
        hit_ratio = None
        if previous is not None and sample.prompt_tokens > previous.prompt_tokens:
            saved = max(0, sample.cached_tokens - previous.cached_tokens)
            hit_ratio = saved / (sample.prompt_tokens - previous.prompt_tokens)
        points.append(
            UsagePoint(
                time=datetime.fromtimestamp(sample.t, UTC),
                active_blocks=sample.active_blocks,
                cached_blocks=sample.cached_blocks,
                reserved_blocks=sample.reserved_blocks,
                quota_blocks=sample.quota_blocks,
                hit_ratio=hit_ratio,
            )
        )
        previous = sample
    return points


def _summary_out(summary: UsageSummary, caller: AdminCaller) -> UsageSummaryOut:
    """The window's summary as `caller` may see it: a tenant-admin gets no share of service."""
    share = summary.service_share if caller.is_admin else None
    return UsageSummaryOut.model_validate({**dataclasses.asdict(summary), "service_share": share})
