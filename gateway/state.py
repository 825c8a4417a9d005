"""Everything a running gateway holds: engine, store, policy, limits, metrics, tracing."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import cached_property

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from engine.engine import Engine
from engine.model_loader import LoadedModel
from gateway.audit_queue import AuditQueue
from gateway.auth import KeyAuthenticator
from gateway.limits import RateLimiter
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.tenancy_sync import TenancySync
from policies.config import PolicyConfig
from policies.planner import SharingPolicy
from policies.registry import build_registry
from tenancy import prefixes
from tenancy.store import Store

logger = logging.getLogger(__name__)


class PolicyHolder:
    """The current sharing policy; its registry is rebuilt when registered prefixes change."""

    def __init__(self, config: PolicyConfig, loaded: LoadedModel, model: str, block_size: int):
        self.config = config
        self._loaded = loaded
        self._model = model
        self._block_size = block_size
        self._entries: tuple[tuple[str, str, str], ...] | None = None
        self.policy = self._build(())

    def _build(self, entries: tuple[tuple[str, str, str], ...]) -> SharingPolicy:
        registry = build_registry(
            self._model, entries, self._loaded.tokenizer, self._block_size,
            self.config.min_public_blocks,
        )  # fmt: skip
        for prefix in registry.too_short:
            logger.warning(
                "public prefix %s/%s is shorter than %d blocks and is not shared",
                prefix.namespace, prefix.name, self.config.min_public_blocks,
            )  # fmt: skip
        return SharingPolicy(self.config, registry)

    def refresh(self, store: Store) -> bool:
        """Reload enabled prefixes for the served model; returns whether anything changed."""
        with store.transaction() as session:
            rows = prefixes.list_prefixes(session, self._model, enabled_only=True)
            entries = tuple((row.namespace, row.name, row.text) for row in rows)
        if entries == self._entries:
            return False
        if self._loaded.tokenizer is None:
            entries = ()  # without a chat template nothing can be matched
        self.policy = self._build(entries)
        self._entries = entries
        return True


@dataclass
class GatewayState:
    settings: Settings
    loaded: LoadedModel
    engine: Engine
    store: Store
    model_name: str
    policy: PolicyHolder
    auth: KeyAuthenticator
    tenancy_sync: TenancySync
    limiter: RateLimiter
    metrics: GatewayMetrics
    tracer_provider: TracerProvider
    audit: AuditQueue
    max_prompt_tokens: int
    prepare_slots: asyncio.Semaphore  # requests being templated and tokenized at once
    tenant_names: dict[str, str] = field(default_factory=dict)
    draining: bool = False

    @cached_property
    def tracer(self) -> Tracer:
        return self.tracer_provider.get_tracer("prefixgate")

    def tenant_name(self, tenant_id: str) -> str:
        return self.tenant_names.get(tenant_id, tenant_id)
