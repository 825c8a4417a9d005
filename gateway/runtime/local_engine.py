"""The engine in a gateway's own process, with the face a gateway reads of what it serves.

`engine.engine.Engine` knows nothing of gateways, workers or served names; `LocalEngine` is that
engine (every caller that drives or inspects it directly still can), plus the few things a
gateway asks of whatever it serves from (serving_engine.py's `ServingEngine`) answered as a
process without workers does: one pool, under the name clients use, and no workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.cache.budget import Owner, TenantBudget
from engine.cache.stats import CacheStats
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class LocalPool:
    """This process's one KV pool, as `ServingEngine.pools` shows a model's pool."""

    model: str
    stats: CacheStats
    served: bool = True
    workers: list[dict[str, Any]] = field(default_factory=list)


class LocalEngine(Engine):
    """An engine serving one model in this process, under the name clients call it by."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, served_name: str) -> None:
        super().__init__(loaded, config)
        self.served_name = served_name

    async def close_connections(self) -> None:
        """Nothing to close: it opened no connections."""

    def know_tenants(self, budgets: Mapping[Owner, TenantBudget], deleted: frozenset[str]) -> None:
        """Each change reaches this engine as it comes (`set_budget`, `purge_tenant`); but a
        disk tier reopened at start may hold entries of tenants deleted while it was down:
        unreadable (their keys are gone), and deleted now."""
        if self.kv_tier is None or not deleted:
            return
        for tenant_id in deleted & {str(owner) for owner in self.kv_tier.stats().owners}:
            self.kv_tier.forget_owner(tenant_id)

    def pools(self) -> list[LocalPool]:
        return [LocalPool(self.served_name, self.cache_stats())]

    def worker_rows(self) -> None:
        return None

    def worker_stats(self) -> dict[str, CacheStats]:
        return {}
