"""What a gateway serves from, whichever it is: the engine in this process, or engine workers.

`ServingEngine` is everything the gateway's lifespan, admin API, console, metrics and tenancy
sync ask of it. Two classes have that face, structurally: `LocalEngine` (local_engine.py), the
engine of this process, and `RemoteEngine` (gateway/workers/remote_engine.py), the workers
behind a routing gateway. What only workers have to show (each worker's load and cache, each
model's pool of workers) is asked of both, and the engine in this process answers it as a
process without workers does, so no caller needs to know which it has. The metrics collector
names the part it reads (gateway/observability/metrics.py's `MeteredEngine`: observability
sits beside runtime, not above it), and the request path asks less of one model's engine
(served_models.py's `ModelEngine`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from engine.cache.budget import Owner, TenantBudget
from engine.cache.kv_spec import KVSpec
from engine.cache.stats import CacheStats
from engine.metrics import TenantService
from engine.model.openmp import ThreadGovernor


class KVPool(Protocol):
    """The KV pool as the gateway reads it: its layout, and the blocks a quota may use."""

    @property
    def spec(self) -> KVSpec: ...

    @property
    def num_blocks(self) -> int: ...


class EngineCounters(Protocol):
    """The engine's counters and step times the gateway shows."""

    @property
    def preemptions(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def step_seconds_total(self) -> float: ...

    @property
    def step_seconds(self) -> Collection[float]:
        """The latest steps' times, in seconds (a routing gateway: its workers' together)."""


class EnginePool(Protocol):
    """One model's KV pool now: its cache (None when none of its workers answers), whether
    it is served (a worker of it is in routing; always, in process), and its workers (none in
    process), each a row as `ServingEngine.worker_rows` gives it."""

    @property
    def model(self) -> str: ...

    @property
    def served(self) -> bool: ...

    @property
    def stats(self) -> CacheStats | None: ...

    @property
    def workers(self) -> list[dict[str, Any]]: ...


class ServingEngine(Protocol):
    """The engine a gateway serves from, as the gateway reads and administers it."""

    @property
    def pool(self) -> KVPool: ...

    @property
    def metrics(self) -> EngineCounters: ...

    @property
    def threads(self) -> ThreadGovernor | None:
        """The CPU threads this process computes with (None: none are governed here)."""

    @property
    def running(self) -> bool: ...

    @property
    def restarts(self) -> int: ...

    def describe(self) -> dict[str, Any]:
        """What serves, for /readyz and the start-up log."""

    def stop(self, timeout: float | None = None) -> None: ...

    async def close_connections(self) -> None:
        """Close what it opened on the event loop (before the loop ends)."""

    def cache_stats(self) -> CacheStats: ...

    def queue_depth(self) -> tuple[int, int]:
        """Sequences waiting and running."""

    def service_stats(self) -> dict[str, TenantService]:
        """Each tenant's service since start (engine/metrics.py's `TenantService`), summed over
        the workers that answer."""

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        """Change an owner's cache budget now; returns blocks evicted."""

    def purge_tenant(self, tenant_id: str) -> int:
        """Drop and zero a deleted tenant's cached blocks; returns how many."""

    def know_tenants(self, budgets: Mapping[Owner, TenantBudget], deleted: frozenset[str]) -> None:
        """The database's whole view of tenants, for parts that missed changes (workers that
        come back); an engine that applies each change as it comes ignores it."""

    def pools(self) -> Sequence[EnginePool]:
        """Every model's pool, by name."""

    def worker_rows(self) -> list[dict[str, Any]] | None:
        """Each engine worker that discovery names: address, model, whether it is in routing,
        load; None for an engine in this process, which has no workers to name."""

    def worker_stats(self) -> dict[str, CacheStats]:
        """Each engine worker's cache statistics, by address (none in process)."""
