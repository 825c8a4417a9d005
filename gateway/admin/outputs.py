"""Tenancy rows as the admin API shows them, with the running engine's view where it has one."""

from __future__ import annotations

import hashlib
import threading
from datetime import datetime
from typing import Any

from gateway.admin.schemas import (
    Amount,
    CacheUsage,
    KeyOut,
    OperatorOut,
    PoolUsage,
    PrefixOut,
    TenantOut,
    WorkerCache,
    unseen_owner,
)
from gateway.runtime.serving_engine import EnginePool
from gateway.state import GatewayState
from policies.templates import system_prompt_tokens
from tenancy.api_keys import key_state
from tenancy.models import Admin, ApiKey, PublicPrefix, Tenant, utcnow


def amount(state: GatewayState, blocks: int) -> Amount:
    """`blocks` KV blocks as blocks, tokens and bytes of the served model's KV cache."""
    spec = state.engine.pool.spec
    return Amount(
        blocks=blocks, tokens=blocks * spec.block_size, bytes=blocks * spec.bytes_per_block
    )


def engine_pools(state: GatewayState) -> list[EnginePool]:
    """Every model's pool, by name: the one in this process, or each workers' model's (a model
    whose workers are all down too, while discovery still names them)."""
    return list(state.engine.pools())


def workers_without_model(state: GatewayState) -> list[dict[str, Any]]:
    """The workers that have not said which model they serve (none of their polls answered)."""
    return [row for row in state.engine.worker_rows() or [] if not row["model"]]


def cache_usage(state: GatewayState, tenant: Tenant) -> CacheUsage:
    """The tenant's cache now: in total, in each model's pool, and on each engine worker when
    there are workers."""
    owner = str(tenant.id)
    quota, reserved = tenant.cache_quota_blocks, tenant.cache_reservation_blocks
    stats = state.engine.cache_stats().owners.get(owner)
    usage = CacheUsage.of_tenant(stats, quota, reserved)
    for pool in engine_pools(state):
        own = pool.stats.owners.get(owner) if pool.stats is not None else None
        usage.pools.append(PoolUsage.of(own or unseen_owner(quota, reserved), model=pool.model))
    models = {row["url"]: row["model"] for row in state.engine.worker_rows() or []}
    for worker, worker_stats in state.engine.worker_stats().items():  # none in process
        own = worker_stats.owners.get(owner)
        usage.workers.append(
            WorkerCache(
                worker=worker,
                model=models.get(worker),
                active_blocks=own.active_blocks if own else 0,
                cached_blocks=own.cached_blocks if own else 0,
                quota_blocks=own.quota_blocks if own else quota,
            )
        )
    return usage


def tenant_out(state: GatewayState, tenant: Tenant) -> TenantOut:
    return TenantOut(
        id=tenant.id,
        slug=tenant.slug,
        display_name=tenant.display_name,
        status=tenant.status,
        sharing_mode=tenant.sharing_mode,
        may_use_public_prefixes=tenant.may_use_public_prefixes,
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        max_concurrent=tenant.max_concurrent,
        scheduling_weight=tenant.scheduling_weight,
        created_at=tenant.created_at,
        quota=amount(state, tenant.cache_quota_blocks),
        reservation=amount(state, tenant.cache_reservation_blocks),
        tier_quota_bytes=tenant.tier_quota_bytes,
        tier_reservation_bytes=tenant.tier_reservation_bytes,
        cache=cache_usage(state, tenant),
    )


def key_out(key: ApiKey, now: datetime | None = None) -> KeyOut:
    return KeyOut(
        key_id=key.key_id,
        name=key.name,
        role=key.role,
        state=key_state(key, now or utcnow()),
        created_at=key.created_at,
        last_used_at=key.last_used_at,
        expires_at=key.expires_at,
        revoked_at=key.revoked_at,
        grace_until=key.grace_until,
    )


def prefix_out(state: GatewayState, prefix: PublicPrefix) -> PrefixOut:
    """A registered prefix with the tokens and whole blocks it shares for its model, when this
    gateway serves that model."""
    tokens = blocks = None
    warning = None
    served = state.models.get(prefix.model)
    tokenizer = served.loaded.tokenizer if served is not None else None
    if served is not None and tokenizer is not None:
        tokens = _token_count(served.loaded.fingerprint, tokenizer, prefix.text)
        blocks = tokens // state.settings.block_size
        minimum = state.models.min_public_blocks
        if blocks < minimum:
            warning = (
                f"shorter than {minimum} whole blocks ({minimum * state.settings.block_size} "
                "tokens): it will not be shared"
            )
        elif tokens >= served.max_prompt_tokens:
            warning = (
                f"{tokens} tokens, at least the longest prompt this gateway accepts "
                f"({served.max_prompt_tokens}): no request can use it"
            )
    elif served is None:
        names = ", ".join(repr(name) for name in state.models.names()) or "no model right now"
        warning = f"this gateway serves {names}, not {prefix.model!r}"
    return PrefixOut(
        id=prefix.id,
        namespace=prefix.namespace,
        name=prefix.name,
        model=prefix.model,
        enabled=prefix.enabled,
        created_by=prefix.created_by,
        created_at=prefix.created_at,
        text=prefix.text,
        tokens=tokens,
        blocks=blocks,
        warning=warning,
    )


def _token_count(fingerprint: str, tokenizer: object, text: str) -> int:
    """Tokens of a registered prompt's system turn in one model, remembered by the model and
    the text's digest: listing prefixes must not re-tokenize every text every time."""
    digest = hashlib.sha256(
        fingerprint.encode() + b"\0" + text.encode("utf-8", "surrogatepass")
    ).digest()
    with _TOKEN_COUNTS_LOCK:
        count = _TOKEN_COUNTS.get(digest)
    if count is None:
        count = len(system_prompt_tokens(tokenizer, text))
        with _TOKEN_COUNTS_LOCK:
            if len(_TOKEN_COUNTS) >= _TOKEN_COUNTS_KEPT:
                _TOKEN_COUNTS.pop(next(iter(_TOKEN_COUNTS)))
            _TOKEN_COUNTS[digest] = count
    return count


_TOKEN_COUNTS: dict[bytes, int] = {}  # by model and text
_TOKEN_COUNTS_KEPT = 1024
_TOKEN_COUNTS_LOCK = threading.Lock()


def operator_out(admin: Admin) -> OperatorOut:
    return OperatorOut(
        id=admin.id,
        username=admin.username,
        role=admin.role,
        tenant_id=admin.tenant_id,
        disabled=admin.disabled,
        second_factor=admin.totp_secret is not None,
        created_at=admin.created_at,
    )
