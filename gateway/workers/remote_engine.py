"""The engine a routing gateway serves from: its workers, with the face a gateway reads of
what it serves (gateway/runtime/serving_engine.py's `ServingEngine`).

The gateway reads and administers it as it does the engine in its own process (budgets,
purges, cache statistics, each tenant's service, step times, queue depth, describe, each
model's `generate`), and reads what only workers have to show (each one's cache and load, each
model's pool) through the same face, which the engine in a process answers as having no
workers: nothing above it knows which it has. A request is streamed by the dispatcher
(dispatch.py), which picks the worker and fails over.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.cache.budget import Owner, TenantBudget
from engine.cache.quotas import OwnerCounters
from engine.cache.stats import CacheStats, OwnerStats
from engine.metrics import TenantService
from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from engine.structured.compile_limits import CompileLimits
from gateway.workers.activity import quantiles, total_service
from gateway.workers.dispatch import Dispatcher
from gateway.workers.membership import WorkerSet
from gateway.workers.models import ModelCatalog
from gateway.workers.remote_model import RemoteModel, RemotePool
from gateway.workers.routing import RoutingConfig
from gateway.workers.worker import Worker

# The engine's choices each worker reports, shown once in `describe` (or "mixed").
_AGREED_CHOICES = (
    "device",
    "dtype",
    "kv_dtype",
    "logits_dtype",
    "attention_backend",
    "linear_kernel",
)


class NoWorker(Exception):
    """No worker answered a starting gateway in time."""


class _Counters:
    """`engine.metrics` as the gateway's Prometheus collector reads it: every worker's totals
    as last reported, summed; the recent step times of those that answer, together."""

    def __init__(self, workers: WorkerSet) -> None:
        self._workers = workers

    @property
    def preemptions(self) -> int:
        return sum(self._workers.snapshot(lambda w: int(w.state.get("preemptions", 0))))

    @property
    def steps(self) -> int:
        return sum(self._workers.snapshot(lambda w: w.activity.steps.steps))

    @property
    def step_seconds_total(self) -> float:
        return float(sum(self._workers.snapshot(lambda w: w.activity.steps.seconds_total)))

    @property
    def step_seconds(self) -> tuple[float, ...]:
        recent = self._workers.snapshot(lambda w: () if w.lost else w.activity.steps.recent)
        return tuple(itertools.chain.from_iterable(recent))


@dataclass(frozen=True, slots=True)
class WorkersPool:
    """One model's KV pool now: its workers' caches summed (None when none of them answers),
    whether one of them is in routing, and each worker as `RemoteEngine.worker_rows` shows it."""

    model: str
    served: bool
    stats: CacheStats | None
    workers: list[dict[str, Any]]


class RemoteEngine:
    """Generation and administration over a set of engine workers, of one model or several."""

    # No CPU threads of this process compute: the workers govern their own.
    threads = None

    def __init__(
        self, workers: WorkerSet, config: RoutingConfig, compile_limits: CompileLimits | None = None
    ) -> None:
        assert workers.models is not None  # a routing gateway learns its models from workers
        self.workers = workers
        self.catalog: ModelCatalog = workers.models
        self.config = config
        self.compile_limits = compile_limits or CompileLimits()
        self.pool = RemotePool(self)
        self.metrics = _Counters(workers)
        self._dispatcher = Dispatcher(workers, config)
        self._models: dict[tuple[str, str], RemoteModel] = {}  # by name and fingerprint
        self._models_lock = threading.Lock()  # read by requests and admin calls, on threads
        self._summed_at: tuple[int, tuple[CacheStats, dict[str, CacheStats]]] | None = None
        self._summed_lock = threading.Lock()

    def start(self, wait_s: float) -> RemoteEngine:
        """Start polling, and wait up to `wait_s` for a worker (`NoWorker` if none answers)."""
        self.workers.start()
        if not self.workers.wait_for_any(wait_s):
            why = self.workers.why_none()
            self.workers.stop()
            raise NoWorker(f"no engine worker answered within {wait_s:g} s ({why})")
        return self

    @property
    def running(self) -> bool:
        return bool(self.workers.routable())

    def stop(self, timeout: float | None = None) -> None:
        """Stop polling (in-flight streams finish on their own) and end the models' grammar
        compile processes."""
        self.workers.stop()
        with self._models_lock:
            for model in self._models.values():
                model.grammars.close()

    async def close_connections(self) -> None:
        """Close the connections to the workers (on the event loop that opened them)."""
        await self._dispatcher.close()

    def generate(
        self, request: GenerationRequest, fingerprint: str
    ) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas from the best worker of its model that takes it."""
        return self._dispatcher.generate(request, fingerprint)

    # -- models -------------------------------------------------------------------------------

    def models(self) -> dict[str, RemoteModel]:
        """Every model with a worker in routing, by name. A name served under two
        fingerprints (a rolling update) is the one with more workers in routing (the one met
        first when they are as many)."""
        counts: dict[tuple[str, str], int] = {}
        for row in self.workers.snapshot(lambda w: (w.model, w.fingerprint) if w.up else None):
            if row is not None:
                counts[row] = counts.get(row, 0) + 1
        best: dict[str, tuple[int, int, str]] = {}
        for (name, fingerprint), count in counts.items():
            rank = (count, -self.catalog.met(fingerprint), fingerprint)
            best[name] = max(best.get(name, (0, -(1 << 63), "")), rank)
        with self._models_lock:
            for key in [key for key in self._models if self.catalog.get(key[1]) is None]:
                self._models.pop(key).grammars.close()  # no worker serves it any more
        served: dict[str, RemoteModel] = {}
        for name, (_, _, fingerprint) in sorted(best.items()):
            model = self._model(name, fingerprint)
            if model is not None:
                served[name] = model
        return served

    def _model(self, name: str, fingerprint: str) -> RemoteModel | None:
        with self._models_lock:
            model = self._models.get((name, fingerprint))
            if model is None:
                loaded = self.catalog.get(fingerprint, name)
                if loaded is None:
                    return None
                model = RemoteModel(self, loaded, self.compile_limits)
                self._models[(name, fingerprint)] = model
            return model

    def routable_states(
        self, fingerprint: str | None = None
    ) -> list[tuple[LoadedModel | None, dict[str, Any]]]:
        """The last state of each worker in routing (of one model, if given), with its model."""
        rows = self.workers.snapshot(
            lambda w: (
                (w.fingerprint, w.state)
                if w.up and w.state and fingerprint in (None, w.fingerprint)
                else None
            )
        )
        return [(self.catalog.get(fp), state) for fp, state in (row for row in rows if row)]

    def knows(self, fingerprint: str) -> bool:
        """Whether a worker this gateway knows serves the model of `fingerprint`."""
        return self.catalog.get(fingerprint) is not None

    def known_models(self, fingerprint: str | None = None) -> list[LoadedModel]:
        """Models this gateway has loaded (of one fingerprint, if given)."""
        fingerprints = {fp for fp in self.workers.snapshot(lambda w: w.fingerprint) if fp}
        found = [self.catalog.get(fp) for fp in sorted(fingerprints)]
        return [m for m in found if m and fingerprint in (None, m.fingerprint)]

    # -- administration -----------------------------------------------------------------------

    def set_budget(self, owner: Owner, budget: TenantBudget) -> int:
        return self.workers.set_budget(owner, budget)

    def purge_tenant(self, tenant_id: str) -> int:
        return self.workers.purge(tenant_id)

    def drop_public_prefix(
        self, namespace: str, token_ids: Any, fingerprint: str | None = None
    ) -> int:
        return self.workers.drop_public_prefix(namespace, list(token_ids), fingerprint)

    def know_tenants(self, budgets: Mapping[Owner, TenantBudget], deleted: frozenset[str]) -> None:
        """The database's whole view of tenants, which a worker that missed a change is given
        when it comes back (membership.py)."""
        self.workers.know_tenants(budgets, deleted)

    # -- what the gateway reads ---------------------------------------------------------------

    def worker_stats(self) -> dict[str, CacheStats]:
        """Each worker's cache statistics as of its last poll (those that answer, draining
        ones too: they still hold blocks)."""
        return {url: stats for url, _, stats in self._answering()}

    def cache_stats(self) -> CacheStats:
        """The workers' caches summed: each tenant's blocks and quota over every worker."""
        return self._summed()[0]

    def _answering(self) -> list[tuple[str, str, CacheStats]]:
        """(url, model, stats) of each worker that answers, as of the last poll."""
        rows = self.workers.snapshot(
            lambda w: None if w.lost or w.stats is None else (w.url, w.model, w.stats)
        )
        return [row for row in rows if row is not None]

    def _summed(self) -> tuple[CacheStats, dict[str, CacheStats]]:
        """Every worker's cache summed, and each model's: worked out once per change of what
        the workers reported (an admin page asks for them once per tenant it shows)."""
        with self._summed_lock:
            version = self.workers.version
            if self._summed_at is None or self._summed_at[0] != version:
                answering = self._answering()
                parts: dict[str, list[CacheStats]] = {}
                for _, model, stats in answering:
                    if model:
                        parts.setdefault(model, []).append(stats)
                summed = (
                    total_stats([stats for _, _, stats in answering]),
                    {model: total_stats(stats) for model, stats in sorted(parts.items())},
                )
                self._summed_at = (version, summed)
            return self._summed_at[1]

    def service_stats(self) -> dict[str, TenantService]:
        """Each tenant's service, summed over the workers that answer (each since it started)."""
        reports = self.workers.snapshot(lambda w: None if w.lost else w.activity.service)
        return total_service(report for report in reports if report is not None)

    def queue_depth(self) -> tuple[int, int]:
        rows = self.workers.snapshot(
            lambda w: (
                (0, 0)
                if w.lost
                else (int(w.state.get("waiting", 0)), int(w.state.get("running", 0)))
            )
        )
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    @property
    def restarts(self) -> int:
        rows = self.workers.snapshot(lambda w: int(w.state.get("describe", {}).get("restarts", 0)))
        return sum(rows)

    def worker_rows(self) -> list[dict[str, Any]]:
        """Each worker that discovery names: address, model, whether it is in routing, load,
        its recent step times' median and p99 and its step-time target (None: not reported)."""
        rows = self.workers.snapshot(lambda w: None if w.unlisted_since is not None else _row(w))
        return [row for row in rows if row is not None]

    def pools(self) -> list[WorkersPool]:
        """Every model's pool, by name: each model a worker answers for, or one that discovery
        still names a worker of (whose workers may all be down)."""
        stats = self._summed()[1]  # those that answer, draining too
        rows = self.worker_rows()
        names = sorted(set(stats) | {row["model"] for row in rows if row["model"]})
        pools = []
        for name in names:
            workers = [row for row in rows if row["model"] == name]
            served = any(row["up"] for row in workers)
            pools.append(WorkersPool(name, served, stats.get(name), workers))
        return pools

    def describe(self) -> dict[str, Any]:
        """What serves, for /readyz and the start-up log: counts, not the workers' addresses
        (/metrics names them; /readyz is public). The engine's choices (device, dtypes,
        kernels) are the value every worker in routing reports, or "mixed"; `kv_blocks` is
        the smallest pool's."""
        rows = self.worker_rows()
        described: list[dict[str, Any]] = [
            w.state.get("describe", {}) for w in self.workers.routable()
        ]
        step_costs = [d["step_cost"] for d in described if d.get("step_cost")]
        tiers = [d["kv_tier"] for d in described if d.get("kv_tier")]
        return {
            "models": sorted(self.models()),
            "routing": self.config.mode,
            "workers": len(rows),
            "workers_up": sum(1 for row in rows if row["up"]),
            **{key: _agreed(d.get(key) for d in described) for key in _AGREED_CHOICES},
            "kv_blocks": self.pool.num_blocks or None,
            **({"step_cost": step_costs} if step_costs else {}),  # each worker's, unnamed
            **({"kv_tier": tiers} if tiers else {}),  # each worker's tier and its cost rule
        }


def _row(worker: Worker) -> dict[str, Any]:
    """A worker as `RemoteEngine.worker_rows` shows it (under the set's lock)."""
    recent = quantiles(worker.activity.steps.recent)
    return {
        "url": worker.url,
        "model": worker.model or None,
        "up": worker.up,
        "in_flight": worker.in_flight,
        "load": worker.reported_load,
        "cached_keys": len(worker.keys),
        "last_error": worker.last_error,
        "step_seconds_p50": recent.get(0.5),
        "step_seconds_p99": recent.get(0.99),
        "step_target_ms": worker.activity.step_target_ms,
    }


def _agreed(values: Iterable[Any]) -> Any:
    """The one value all workers report (None with no worker), or "mixed"."""
    distinct = set(values)
    if len(distinct) > 1:
        return "mixed"
    return next(iter(distinct), None)


def total_stats(parts: list[CacheStats]) -> CacheStats:
    """Several caches as one: every count summed, each owner's over the caches it is in."""
    owners: dict[Owner, OwnerStats] = {}
    for stats in parts:
        for owner, own in stats.owners.items():
            seen = owners.get(owner)
            owners[owner] = own if seen is None else _add_owner(seen, own)
    zero = CacheStats(0, 0, 0, 0, 0, 0, 0, {})
    total = zero
    kinds = {stats.tier_kind for stats in parts}
    if kinds == {"redis"}:  # one store every worker reads: its usage is counted once
        owners = {owner: _held_once(own, parts, owner) for owner, own in owners.items()}
        capacity = max(stats.tier_capacity_bytes for stats in parts)
    else:
        capacity = sum(stats.tier_capacity_bytes for stats in parts)
    tier_kind = _agreed(kinds - {None})
    total = replace(total, tier_kind=tier_kind, tier_capacity_bytes=capacity)
    for stats in parts:
        total = replace(
            total,
            num_blocks=total.num_blocks + stats.num_blocks,
            free_blocks=total.free_blocks + stats.free_blocks,
            cached_keys=total.cached_keys + stats.cached_keys,
            blocks_zeroed=total.blocks_zeroed + stats.blocks_zeroed,
            zero_operations=total.zero_operations + stats.zero_operations,
            collisions=total.collisions + stats.collisions,
            peak_active_blocks=total.peak_active_blocks + stats.peak_active_blocks,
        )
    return replace(total, owners=owners)


def _held_once(total: OwnerStats, parts: list[CacheStats], owner: Owner) -> OwnerStats:
    """An owner's summed stats with what it holds in a shared tier taken once, not once per
    worker (each worker reads the same store; the newest reading wins)."""
    held = [stats.owners[owner] for stats in parts if owner in stats.owners]
    return replace(
        total,
        tier_bytes=max(own.tier_bytes for own in held),
        tier_entries=max(own.tier_entries for own in held),
        tier_quota_bytes=max(own.tier_quota_bytes for own in held),
        tier_reserved_bytes=max(own.tier_reserved_bytes for own in held),
    )


def _add_owner(a: OwnerStats, b: OwnerStats) -> OwnerStats:
    counters = OwnerCounters(
        **{
            name: getattr(a.counters, name) + getattr(b.counters, name)
            for name in a.counters.__dataclass_fields__
        }
    )
    sums = {
        name: getattr(a, name) + getattr(b, name)
        for name in a.__dataclass_fields__
        if name != "counters"
    }
    return OwnerStats(**sums, counters=counters)
