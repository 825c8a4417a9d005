"""Prometheus metrics: per-app registry, request counters, latency histograms, and the engine's
cache, queue, service per tenant and step times read at scrape time.

Series that name a tenant (`tenant` and `owner` labels) are shown only to a scraper that
presents the metrics token; without it, a scrape sees the service as a whole and the public
budget, and no tenant's identity or traffic. A routing gateway shows its workers' engines
together: counters summed over them, recent step times pooled, and each worker's own figures
labelled with its address.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.cache.budget import PUBLIC_OWNER, Owner
from engine.cache.stats import CacheStats
from engine.metrics import TenantService
from engine.model.openmp import ThreadGovernor
from gateway.limits.limiter import Limiter
from gateway.workers.activity import quantiles
from tenancy.audit_log import AuditLog

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCounters(Protocol):
    """The engine's counters and step times the collector shows."""

    @property
    def preemptions(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def step_seconds_total(self) -> float: ...

    @property
    def step_seconds(self) -> Collection[float]:
        """The latest steps' times, in seconds."""


class MeteredEngine(Protocol):
    """What the collector reads of the engine a gateway serves from, in this process or on
    workers (gateway/runtime/serving_engine.py's `ServingEngine` has all of it)."""

    @property
    def metrics(self) -> _EngineCounters: ...

    @property
    def restarts(self) -> int: ...

    @property
    def threads(self) -> ThreadGovernor | None: ...

    def describe(self) -> dict[str, Any]: ...

    def cache_stats(self) -> CacheStats: ...

    def queue_depth(self) -> tuple[int, int]: ...

    def service_stats(self) -> dict[str, TenantService]: ...

    def worker_rows(self) -> list[dict[str, Any]] | None: ...


class GatewayMetrics:
    """The app's own registry: request counters and histograms, plus gauges read on scrape."""

    def __init__(
        self,
        engine: MeteredEngine,
        audit: AuditLog,
        tenant_name: Callable[[str], str],
        limiter: Limiter | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "prefixgate_requests",
            "HTTP API requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "prefixgate_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "prefixgate_request_duration_seconds",
            "End-to-end request latency.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "prefixgate_prompt_tokens",
            "Prompt tokens per tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "prefixgate_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            ["tenant"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "prefixgate_completion_tokens",
            "Generated tokens per tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, tenant_name))
        if limiter is not None:
            self.registry.register(LimiterCollector(limiter))
            self.registry.register(limiter.round_trips)
        Gauge(
            "prefixgate_audit_dead_letters",
            "Audit events the database refused (in the file).",
            registry=self.registry,
        ).set_function(audit.dead_letters)
        Gauge(
            "prefixgate_audit_spooled_events",
            "Audit events waiting for the database.",
            registry=self.registry,
        ).set_function(audit.pending)

    def exposition(self, include_tenants: bool) -> bytes:
        """The text exposition; per-tenant series only when `include_tenants`."""
        if include_tenants:
            return generate_latest(self.registry)
        return generate_latest(_WithoutTenants(self.registry))


class _WithoutTenants(Collector):
    """A view of a registry with every sample that names a tenant left out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [
                sample
                for sample in family.samples
                if "tenant" not in sample.labels
                and sample.labels.get("owner", "public") == "public"
            ]
            yield family


class EngineCollector(Collector):
    """Cache blocks per owner vs quota, evictions, zeroing, queue depth, service per tenant
    and step times, read on scrape."""

    def __init__(self, engine: MeteredEngine, tenant_name: Callable[[str], str]) -> None:
        self._engine = engine
        self._tenant_name = tenant_name

    def _owner(self, owner: Owner) -> str:
        return "public" if owner is PUBLIC_OWNER else self._tenant_name(str(owner))

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.cache_stats()
        blocks = GaugeMetricFamily(
            "prefixgate_kv_cache_blocks",
            "KV blocks per owner by state (and its quota).",
            labels=["owner", "state"],
        )
        evictions = CounterMetricFamily(
            "prefixgate_kv_cache_evictions", "Cached blocks evicted, per owner.", labels=["owner"]
        )
        for owner, owner_stats in stats.owners.items():
            name = self._owner(owner)
            blocks.add_metric([name, "active"], owner_stats.active_blocks)
            blocks.add_metric([name, "cached"], owner_stats.cached_blocks)
            blocks.add_metric([name, "reserved"], owner_stats.reserved_blocks)
            blocks.add_metric([name, "quota"], owner_stats.quota_blocks)
            evictions.add_metric([name], owner_stats.counters.evicted_blocks)
        yield blocks
        yield evictions
        pool = GaugeMetricFamily(
            "prefixgate_kv_cache_pool_blocks", "KV pool blocks by state.", labels=["state"]
        )
        pool.add_metric(["total"], stats.num_blocks)
        pool.add_metric(["free"], stats.free_blocks)
        yield pool
        yield CounterMetricFamily(
            "prefixgate_kv_cache_zeroed_blocks",
            "KV blocks zeroed before reuse.",
            value=stats.blocks_zeroed,
        )
        yield CounterMetricFamily(
            "prefixgate_kv_cache_key_collisions",
            "Block-key hits rejected by verification.",
            value=stats.collisions,
        )
        waiting, running = self._engine.queue_depth()
        depth = GaugeMetricFamily(
            "prefixgate_queue_depth", "Sequences in the engine.", labels=["state"]
        )
        depth.add_metric(["waiting"], waiting)
        depth.add_metric(["running"], running)
        yield depth
        yield CounterMetricFamily(
            "prefixgate_engine_preemptions",
            "Sequences preempted for recompute.",
            value=self._engine.metrics.preemptions,
        )
        yield CounterMetricFamily(
            "prefixgate_engine_restarts",
            "Times the engine failed outside any one request and restarted its state.",
            value=self._engine.restarts,
        )
        if stats.tier_kind is not None:
            yield from self._tier_metrics(stats)
        yield from _service_metrics(self._engine.service_stats(), self._tenant_name)
        yield from _step_metrics(self._engine)
        if self._engine.threads is not None:
            yield from _thread_metrics(self._engine.threads)
        rows = self._engine.worker_rows()
        if rows is not None:  # a routing gateway: its workers' families, even with none named
            yield from _worker_metrics(rows)

    def _tier_metrics(self, stats: CacheStats) -> Iterator[Metric]:
        """The second KV tier per owner: bytes held against its budget, and the traffic."""
        held = GaugeMetricFamily(
            "prefixgate_kv_tier_bytes",
            "Bytes per owner in the second KV tier, by kind (held, quota, reserved).",
            labels=["owner", "kind"],
        )
        traffic = CounterMetricFamily(
            "prefixgate_kv_tier_blocks",
            "Blocks moved to and from the second KV tier per owner, by event.",
            labels=["owner", "event"],
        )
        for owner, own in stats.owners.items():
            name = self._owner(owner)
            held.add_metric([name, "held"], own.tier_bytes)
            held.add_metric([name, "quota"], own.tier_quota_bytes)
            held.add_metric([name, "reserved"], own.tier_reserved_bytes)
            for event, count in (
                ("offloaded", own.tier_offloads),
                ("loaded", own.tier_loads),
                ("missed", own.tier_misses),
                ("dropped", own.tier_drops),
                ("evicted", own.tier_evicted),
                ("purged", own.tier_purged),
            ):
                traffic.add_metric([name, event], count)
        yield held
        yield traffic
        yield GaugeMetricFamily(
            "prefixgate_kv_tier_capacity_bytes",
            "Capacity of the second KV tier.",
            value=stats.tier_capacity_bytes,
        )


class LimiterCollector(Collector):
    """Where tenants' limits are kept now, and the steps counted here while Redis was away."""

    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[Metric]:
        limiter = self._limiter
        yield GaugeMetricFamily(
            "prefixgate_limits_shared",
            "1 while tenants' limits are kept in the shared store (Redis), 0 while this "
            "gateway limits alone (no Redis configured, or Redis away: fail-open).",
            value=1 if limiter.shared_now else 0,
        )
        yield CounterMetricFamily(
            "prefixgate_limits_fallback_steps",
            "Admission steps counted in this process because the shared store did not answer.",
            value=limiter.fallbacks,
        )


def _thread_metrics(threads: ThreadGovernor) -> Iterator[Metric]:
    """The CPU threads the engine computes with (engine/model/openmp.py `ThreadGovernor`)."""
    yield GaugeMetricFamily(
        "prefixgate_engine_cpu_threads",
        "OpenMP threads the engine's steps compute with now (fewer while the CPUs are busy).",
        value=threads.threads,
    )
    yield CounterMetricFamily(
        "prefixgate_engine_cpu_narrowings",
        "Times the engine went from all its threads to fewer because its thread waited for a CPU.",
        value=threads.narrowed,
    )
    if threads.last_narrowed_at is not None:
        yield GaugeMetricFamily(
            "prefixgate_engine_cpu_last_narrowing_timestamp_seconds",
            "When the engine last went from all its threads to fewer (Unix time).",
            value=threads.last_narrowed_at,
        )
        yield GaugeMetricFamily(
            "prefixgate_engine_cpu_last_narrowing_waited_ratio",
            "Why: the share of its recent steps' time the engine thread had waited for a CPU.",
            value=threads.last_waited_share,
        )


def _service_metrics(
    service: dict[str, TenantService], tenant_name: Callable[[str], str]
) -> Iterator[Metric]:
    """Each tenant's service since the engine started (engine/metrics.py `TenantService`)."""
    tokens = CounterMetricFamily(
        "prefixgate_engine_service_tokens",
        "Tokens the engine computed for each tenant: prompt positions prefilled (cached ones "
        "are free) and tokens decoded.",
        labels=["tenant", "kind"],
    )
    weighted = CounterMetricFamily(
        "prefixgate_engine_service_weighted_tokens",
        "Each tenant's service in prefill-token units (decodes weighted by their measured "
        "cost; before the tenant's scheduling weight): what fair scheduling shares out.",
        labels=["tenant"],
    )
    for tenant_id, served in service.items():
        name = tenant_name(tenant_id)
        tokens.add_metric([name, "prefill"], served.prefill_tokens)
        tokens.add_metric([name, "decode"], served.decode_tokens)
        weighted.add_metric([name], served.service)
    yield tokens
    yield weighted


def _step_metrics(engine: MeteredEngine) -> Iterator[Metric]:
    """The engine's steps: how many, their time, the latest ones' quantiles, the target."""
    counters = engine.metrics
    yield CounterMetricFamily("prefixgate_engine_steps", "Engine steps run.", value=counters.steps)
    yield CounterMetricFamily(
        "prefixgate_engine_step_seconds",
        "Time spent in engine steps.",
        value=counters.step_seconds_total,
    )
    recent = GaugeMetricFamily(
        "prefixgate_engine_step_seconds_recent",
        "Quantiles of the latest engine steps' times.",
        labels=["quantile"],
    )
    for quantile, seconds in quantiles(counters.step_seconds).items():
        recent.add_metric([f"{quantile:g}"], seconds)
    yield recent
    step_cost = engine.describe().get("step_cost")
    if isinstance(step_cost, Mapping) and step_cost.get("target_ms") is not None:
        yield GaugeMetricFamily(
            "prefixgate_engine_step_target_seconds",
            "The time the engine keeps a step within while other tenants wait on it.",
            value=float(step_cost["target_ms"]) / 1000,
        )


def _worker_metrics(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    """Each engine worker a routing gateway knows: in routing or not, its load and its steps."""
    up = GaugeMetricFamily(
        "prefixgate_worker_up", "1 while the engine worker is in routing.", labels=["worker"]
    )
    in_flight = GaugeMetricFamily(
        "prefixgate_worker_in_flight",
        "This gateway's requests on the engine worker now.",
        labels=["worker"],
    )
    recent = GaugeMetricFamily(
        "prefixgate_worker_step_seconds_recent",
        "Quantiles of the engine worker's latest steps' times.",
        labels=["worker", "quantile"],
    )
    target = GaugeMetricFamily(
        "prefixgate_worker_step_target_seconds",
        "The time the engine worker keeps a step within while other tenants wait on it.",
        labels=["worker"],
    )
    for row in rows:
        up.add_metric([row["url"]], 1 if row["up"] else 0)
        in_flight.add_metric([row["url"]], row["in_flight"])
        for quantile, key in ((0.5, "step_seconds_p50"), (0.99, "step_seconds_p99")):
            if row[key] is not None:
                recent.add_metric([row["url"], f"{quantile:g}"], row[key])
        if row["step_target_ms"] is not None:
            target.add_metric([row["url"]], row["step_target_ms"] / 1000)
    yield up
    yield in_flight
    yield recent
    yield target
