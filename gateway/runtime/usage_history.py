"""Recent usage per owner, kept in memory for the admin console's charts.

Every `interval_s` (2 s by default) the gateway calls `sample` with the engine's cache stats and
each tenant's service, and each owner (a tenant id, or "public" for the public budget) gets one
`UsageSample`: its blocks now (active, cached, reserved, quota) and its running totals (prompt
and cached tokens, evictions own and pressure, purged blocks, requests and errors, the service
the engine gave it and the service it gave every tenant together). The totals only grow, so a
window's activity is the difference of two samples, and a missed or late sample loses no
traffic; a tenant's observed share of service over a window is its service's growth over all
tenants' (what its scheduling weight is meant to set when others have work too).

Memory is bounded: one ring (`deque(maxlen)`) per owner holds `retention_s` worth of samples
(15 min, 450 samples by default); an owner absent from the stats, with no requests counted, for
a whole `retention_s` is dropped, and so is a tenant the gateway `forget`s (it was deleted).
Nothing is persisted: a restart starts an empty history.

Request outcomes reach it from the event loop (`count_request`) while sampling may run in a
worker thread, so one lock guards everything.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.stats import CacheStats, OwnerStats
from engine.metrics import TenantService

PUBLIC = "public"  # the public budget's name in the history
_Total = TypeVar("_Total", int, float)  # a running total: a count, or service


@dataclass(frozen=True, slots=True)
class UsageSample:
    """One owner at one moment: blocks now, and running totals since the process started."""

    t: float  # wall-clock epoch seconds
    active_blocks: int
    cached_blocks: int
    reserved_blocks: int
    quota_blocks: int
    prompt_tokens: int
    cached_tokens: int
    evicted_own_blocks: int
    evicted_pressure_blocks: int
    purged_blocks: int
    requests: int
    errors: int
    service: float  # in the engine's units (engine/metrics.py's `TenantService`)
    all_tenants_service: float  # every tenant's service together, at the same moment


_ZERO = UsageSample(0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class UsageSummary:
    """What an owner did during a window: differences of the running totals."""

    prompt_tokens: int = 0
    prefill_tokens_saved: int = 0  # prompt tokens served from the cache
    hit_ratio: float = 0.0  # prefill_tokens_saved / prompt_tokens, 0 without prompts
    evicted_own_blocks: int = 0
    evicted_pressure_blocks: int = 0
    requests: int = 0
    errors: int = 0
    service: float = 0.0
    service_share: float = 0.0  # service / every tenant's service, 0 when nothing was served


@dataclass(frozen=True, slots=True)
class UsageWindow:
    """The samples of the last `seconds` (oldest first) and what happened during them."""

    seconds: float
    samples: list[UsageSample]
    summary: UsageSummary


@dataclass(slots=True)
class _Requests:
    requests: int = 0
    errors: int = 0


@dataclass(slots=True)
class _Track:
    samples: deque[UsageSample]
    last_seen: float
    # Every tenant's service at the sample before the owner's first (its own was zero then).
    served_before: float
    # Still holds the owner's first sample: before it, every counter was zero.
    complete: bool = True


class UsageHistory:
    """Per-owner rings of usage samples; every method is safe from any thread."""

    def __init__(self, interval_s: float = 2.0, retention_s: float = 900.0) -> None:
        if interval_s <= 0 or retention_s < interval_s:
            raise ValueError("need 0 < interval_s <= retention_s")
        self.interval_s = interval_s  # how often the gateway should call `sample`
        self.retention_s = retention_s
        self._tracks: dict[str, _Track] = {}
        self._requests: dict[str, _Requests] = {}
        # Forgotten tenants the engine still reports: not sampled again until they make a request.
        self._forgotten: set[str] = set()
        self._served = 0.0  # every tenant's service at the last sample
        self._lock = threading.Lock()

    @property
    def max_samples(self) -> int:
        """How many samples one owner's ring holds."""
        return math.ceil(self.retention_s / self.interval_s)

    def count_request(self, tenant_id: str, failed: bool) -> None:
        """Count one settled request of the tenant (and an error if it `failed`)."""
        with self._lock:
            self._forgotten.discard(tenant_id)
            tally = self._requests.setdefault(tenant_id, _Requests())
            tally.requests += 1
            tally.errors += int(failed)

    def sample(
        self,
        stats: CacheStats,
        service: Mapping[str, TenantService],
        now: float | None = None,
    ) -> None:
        """Append one sample per owner in `stats` or `service` (the engine's totals by tenant
        id) and per tenant with counted requests."""
        now = time.time() if now is None else now
        owners = {owner_name(owner): owner_stats for owner, owner_stats in stats.owners.items()}
        served = sum(tenant.service for tenant in service.values())
        with self._lock:
            self._forgotten &= owners.keys() | service.keys()  # the engine let go of them too
            for name in (owners.keys() | service.keys() | self._requests.keys()) - self._forgotten:
                track = self._tracks.get(name)
                if track is None:
                    track = _Track(deque(maxlen=self.max_samples), now, self._served)
                    self._tracks[name] = track
                tally = self._requests.get(name, _Requests())
                if len(track.samples) == track.samples.maxlen:
                    track.complete = False
                own = service.get(name, TenantService())
                track.samples.append(_sample(now, owners.get(name), tally, own.service, served))
                track.last_seen = now
            self._served = served
            for name, track in list(self._tracks.items()):
                if now - track.last_seen >= self.retention_s:  # gone for a whole retention
                    self._drop(name)

    def window(self, owner: str, seconds: float, now: float | None = None) -> UsageWindow:
        """The owner's samples of the last `seconds` and a summary of that span.

        The summary runs from the newest sample before the window (so a 60 s window counts
        60 s of traffic, not one interval less) or, without one, from zero (the ring still
        holds the owner's first sample) or the window's first sample, to its last. An owner
        without samples gets an empty window.
        """
        start = (time.time() if now is None else now) - seconds
        with self._lock:
            track = self._tracks.get(owner)
            if track is None:
                return UsageWindow(seconds, [], UsageSummary())
            history = list(track.samples)
            # Without a sample before the window, a ring that never dropped one starts from
            # zero (a new tenant's first requests happened before its first sample), and every
            # tenant's service from what it was at the sample before.
            origin = (
                replace(_ZERO, all_tenants_service=track.served_before)
                if track.complete
                else history[0]
            )
        inside = [sample for sample in history if sample.t > start]
        before = [sample for sample in history if sample.t <= start]
        if not inside:
            return UsageWindow(seconds, [], UsageSummary())
        first = before[-1] if before else origin
        return UsageWindow(seconds, inside, _summary(first, inside[-1]))

    def forget(self, tenant_id: str) -> None:
        """Drop a tenant's history (it was deleted); it reappears only if it makes a request."""
        with self._lock:
            self._drop(tenant_id)
            self._forgotten.add(tenant_id)

    def owners(self) -> list[str]:
        """Every owner with a history."""
        with self._lock:
            return list(self._tracks)

    def _drop(self, name: str) -> None:
        self._tracks.pop(name, None)
        self._requests.pop(name, None)


def owner_name(owner: Owner) -> str:
    """The history's name for an engine owner: the tenant id, or "public"."""
    return PUBLIC if owner is PUBLIC_OWNER else str(owner)


def _sample(
    now: float, stats: OwnerStats | None, tally: _Requests, service: float, served: float
) -> UsageSample:
    """An owner's sample; one the engine does not report (refused before it got a block)
    holds no blocks and counts only its requests. `served`: every tenant's service."""
    stats = stats or OwnerStats(0, 0, 0, 0)
    counters = stats.counters
    return UsageSample(
        t=now,
        active_blocks=stats.active_blocks,
        cached_blocks=stats.cached_blocks,
        reserved_blocks=stats.reserved_blocks,
        quota_blocks=stats.quota_blocks,
        prompt_tokens=counters.prompt_tokens,
        cached_tokens=counters.cached_tokens,
        evicted_own_blocks=counters.evicted_own_blocks,
        evicted_pressure_blocks=counters.evicted_pressure_blocks,
        purged_blocks=counters.purged_blocks,
        requests=tally.requests,
        errors=tally.errors,
        service=service,
        all_tenants_service=served,
    )


def _summary(first: UsageSample, last: UsageSample) -> UsageSummary:
    prompt_tokens = _grown(first.prompt_tokens, last.prompt_tokens)
    saved = _grown(first.cached_tokens, last.cached_tokens)
    service = _grown(first.service, last.service)
    everyone = _grown(first.all_tenants_service, last.all_tenants_service)
    return UsageSummary(
        prompt_tokens=prompt_tokens,
        prefill_tokens_saved=saved,
        hit_ratio=saved / prompt_tokens if prompt_tokens else 0.0,
        evicted_own_blocks=_grown(first.evicted_own_blocks, last.evicted_own_blocks),
        evicted_pressure_blocks=_grown(first.evicted_pressure_blocks, last.evicted_pressure_blocks),
        requests=_grown(first.requests, last.requests),
        errors=_grown(first.errors, last.errors),
        service=service,
        # At most 1: behind a routing gateway a worker that stops answering leaves the sum.
        service_share=min(1.0, service / everyone) if everyone > 0 else 0.0,
    )


def _grown(first: _Total, last: _Total) -> _Total:
    # Totals never shrink within one engine; clamp so a reset never reads as negative use.
    return max(0, last - first)
