"""Everything a running gateway holds: engine, store, policy, limits, metrics, tracing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cached_property

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from gateway.auth.admin_tokens import AdminTokens
from gateway.auth.key_auth import KeyAuthenticator
from gateway.auth.login_throttle import LoginThrottle, SlidingWindow
from gateway.limits.limiter import Limiter
from gateway.limits.tenant_turns import TenantTurns
from gateway.observability.metrics import GatewayMetrics
from gateway.runtime.audit_queue import AuditQueue
from gateway.runtime.peers import Peers
from gateway.runtime.seal_keys import SealKeyCache
from gateway.runtime.served_models import ServedModels
from gateway.runtime.serving_engine import ServingEngine
from gateway.runtime.tenancy_sync import TenancySync
from gateway.runtime.usage_history import UsageHistory
from gateway.settings import Settings
from tenancy.admins import SecondFactorRules
from tenancy.change_feed import ChangeListener
from tenancy.store import Store
from tenancy.totp import TotpCipher


@dataclass
class GatewayState:
    """What the app's lifespan builds once and every request reads."""

    settings: Settings
    engine: ServingEngine  # in this process, or engine workers behind a router
    models: ServedModels  # what clients may name in `model`, each with its tokenizer and policy
    store: Store
    auth: KeyAuthenticator
    tenancy_sync: TenancySync
    tenancy_listener: ChangeListener  # tenancy changes notified at once (PostgreSQL)
    limiter: Limiter  # each tenant's limits: in Redis for every gateway, or this process's
    peers: Peers  # the gateways serving this deployment
    metrics: GatewayMetrics
    tracer_provider: TracerProvider
    audit: AuditQueue
    prepare_slots: asyncio.Semaphore  # requests being templated and tokenized at once
    compile_turns: TenantTurns  # grammars compiling, one per tenant at a time
    admin_tokens: AdminTokens
    login_throttle: LoginThrottle
    admin_changes: SlidingWindow  # changes per admin caller each minute
    usage: UsageHistory  # live cache usage per tenant, for the console's charts
    tenant_names: dict[str, str] = field(default_factory=dict)  # id -> slug, for metrics
    # Data keys requests carry to a second KV tier (None: the deployment has no tier).
    seal_keys: SealKeyCache | None = None
    draining: bool = False
    # Whether the warning that a proxy in front of this gateway is not trusted was logged.
    untrusted_proxy_warned: bool = False

    @cached_property
    def tracer(self) -> Tracer:
        return self.tracer_provider.get_tracer("prefixgate")

    @cached_property
    def second_factor_rules(self) -> SecondFactorRules:
        """How operator logins treat TOTP: secrets encrypted under a key derived from the
        key-hashing secret (which the database never holds and which every gateway shares),
        and whether an `admin` must have one."""
        cipher = TotpCipher.from_secret(self.settings.secret("key_hash_secret"))
        return SecondFactorRules(cipher, self.settings.admin_totp_required)
