"""bench.fairness' accounting: each tenant's service over time, and the shares, rates and
latency percentiles the bench reports from it. See bench/fairness.py.

Service is read from the server's /metrics (with the metrics token), sampled every
`SAMPLE_INTERVAL_S` while a scenario runs: `SERVICE_FAMILY`, per tenant, in prefill-token units
(decodes weighted by their measured cost: what fair scheduling shares out), for shares; and
`TOKENS_FAMILY`, the tokens computed per tenant (prompt positions prefilled and tokens
decoded), for rates in tokens per second. Both move only when a step ends. A server without
them leaves the answers' usage, for both: each answered request's prompt and completion
tokens, spread evenly over the time from its sending to its answer (a request is served, step
by step, over that span). That is an estimate: it cannot tell when within its span a request
was served, and a request still in flight when its traffic stopped counts nothing. A series is
cumulative service per tenant at the sampler's moments, whichever the source.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import percentile
from bench.fairness_load import Answer

SERVICE_FAMILY = "prefixgate_engine_service_weighted_tokens_total"
TOKENS_FAMILY = "prefixgate_engine_service_tokens_total"
SAMPLE_INTERVAL_S = 0.5
IDLE_TIMEOUT_S = 120.0  # for the engine to drop what a stopped flood left in flight

# Cumulative service per tenant, at moments of `time.monotonic()`.
Series = list[tuple[float, dict[str, float]]]


@dataclass(frozen=True, slots=True)
class Sample:
    """One scrape of /metrics: weighted service and tokens computed per tenant label (a slug,
    or an id before the tenant's first request), sequences in the engine, the threads its
    steps compute with, and its steps so far with their time."""

    at: float
    service: dict[str, float]
    tokens: dict[str, float]
    queued: int = 0
    threads: int | None = None
    steps: int = 0
    step_seconds: float = 0.0


def parse_metrics(text: str, at: float) -> Sample:
    """The families the bench reads, from Prometheus text."""
    service: dict[str, float] = {}
    tokens: dict[str, float] = {}
    found: dict[str, float] = {}
    queued = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == SERVICE_FAMILY:
                service[sample.labels["tenant"]] = sample.value
            elif sample.name == TOKENS_FAMILY:
                tenant = sample.labels["tenant"]
                tokens[tenant] = tokens.get(tenant, 0.0) + sample.value
            elif sample.name == "prefixgate_queue_depth":
                queued += int(sample.value)
            else:
                found[sample.name] = sample.value
    threads = found.get("prefixgate_engine_cpu_threads")
    return Sample(
        at,
        service,
        tokens,
        queued,
        None if threads is None else int(threads),
        int(found.get("prefixgate_engine_steps_total", 0)),
        found.get("prefixgate_engine_step_seconds_total", 0.0),
    )


@dataclass
class ServiceSampler:
    """Scrapes /metrics every `interval_s` in the background of this process's event loop."""

    url: str
    metrics_token: str
    interval_s: float = SAMPLE_INTERVAL_S
    samples: list[Sample] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ServiceSampler:
        self._task = asyncio.ensure_future(self._run())
        await self.scrape()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def scrape(self) -> Sample:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            response = await client.get(
                "/metrics", headers={"Authorization": f"Bearer {self.metrics_token}"}
            )
        response.raise_for_status()
        sample = parse_metrics(response.text, time.monotonic())
        self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    @property
    def has_service(self) -> bool:
        """Whether the server reports service per tenant (else usage is the source)."""
        return any(sample.service for sample in self.samples)

    async def wait_idle(self) -> None:
        """Until the engine holds no sequence (a stopped flood's requests are dropped once
        the server sees their connections close)."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (await self.scrape()).queued and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    def between(self, start: float, end: float) -> list[Sample]:
        return [sample for sample in self.samples if start <= sample.at <= end]


def metrics_series(
    samples: Iterable[Sample], slugs: Mapping[str, str], tokens: bool = False
) -> Series:
    """Weighted service (or, with `tokens`, tokens computed) per slug from the samples;
    `slugs` maps every label a tenant may carry (its id, its slug) to its slug; other tenants
    are left out."""
    series: Series = []
    for sample in samples:
        service: dict[str, float] = {}
        for label, value in (sample.tokens if tokens else sample.service).items():
            if label in slugs:
                service[slugs[label]] = service.get(slugs[label], 0.0) + value
        series.append((sample.at, service))
    return series


def usage_series(answers: Iterable[Answer], moments: Sequence[float]) -> Series:
    """Service per tenant from answered requests' usage, each spread evenly over its span."""
    series: Series = [(moment, {}) for moment in moments]
    for answer in answers:
        if not answer.tokens:
            continue
        span = max(answer.done_at - answer.sent_at, 1e-9)
        for moment, service in series:
            served = min(1.0, max(0.0, (moment - answer.sent_at) / span))
            service[answer.tenant] = service.get(answer.tenant, 0.0) + served * answer.tokens
    return series


def value_at(series: Series, moment: float) -> dict[str, float]:
    """Each tenant's cumulative service at `moment`, linear between samples (clamped to the
    first and last)."""
    if not series:
        return {}
    moments = [at for at, _ in series]
    index = bisect.bisect_left(moments, moment)
    if index == 0:
        return dict(series[0][1])
    if index == len(series):
        return dict(series[-1][1])
    (before, low), (after, high) = series[index - 1], series[index]
    weight = (moment - before) / (after - before) if after > before else 1.0
    tenants = set(low) | set(high)
    return {t: low.get(t, 0.0) + weight * (high.get(t, 0.0) - low.get(t, 0.0)) for t in tenants}


def served(series: Series, start: float, end: float) -> dict[str, float]:
    """Service each tenant received between `start` and `end`."""
    first, last = value_at(series, start), value_at(series, end)
    return {tenant: last[tenant] - first.get(tenant, 0.0) for tenant in last}


def rate(series: Series, tenant: str, start: float, end: float) -> float | None:
    """A tenant's service per second between the first and the last sample in the window at
    which it had grown: counters move when a step ends, so this counts whole steps only, where
    the window's edges would cut steps in two."""
    points = [(at, service.get(tenant, 0.0)) for at, service in series if start <= at <= end]
    grown = [now for before, now in itertools.pairwise(points) if now[1] > before[1]]
    if len(grown) < 2:
        return None
    (first_at, first), (last_at, last) = grown[0], grown[-1]
    return (last - first) / (last_at - first_at)


def shares(service: Mapping[str, float], tenants: Sequence[str]) -> dict[str, float | None]:
    """Each of `tenants`' part of their service together (None each where none was served)."""
    total = sum(service.get(tenant, 0.0) for tenant in tenants)
    return {
        tenant: round(service.get(tenant, 0.0) / total, 4) if total > 0 else None
        for tenant in tenants
    }


def share_timeline(
    series: Series, tenants: Sequence[str], start: float, end: float, window_s: float
) -> dict[str, Any]:
    """Each tenant's share of the service in the `window_s` before each sample, from `start`
    (times in seconds from `start`), for the plot."""
    times: list[float] = []
    timeline: dict[str, list[float | None]] = {tenant: [] for tenant in tenants}
    for moment, _ in series:
        if start + window_s <= moment <= end:
            times.append(round(moment - start, 2))
            for tenant, share in shares(served(series, moment - window_s, moment), tenants).items():
                timeline[tenant].append(share)
    return {"t_s": times, "shares": timeline}


def latency(answers: Sequence[Answer]) -> dict[str, Any]:
    """Latency p50/p99 of the answered requests, and every status seen."""
    seconds = [answer.latency_s for answer in answers if answer.status == 200]
    statuses = Counter(str(answer.status) for answer in answers)
    if not seconds:
        return {"requests": 0, "p50_ms": None, "p99_ms": None, "statuses": dict(statuses)}
    return {
        "requests": len(seconds),
        "p50_ms": round(percentile(seconds, 0.5) * 1000, 1),
        "p99_ms": round(percentile(seconds, 0.99) * 1000, 1),
        "statuses": dict(statuses),
    }
