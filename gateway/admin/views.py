"""Tenancy rows as the admin API shows them, with the running engine's view where it has one."""

from __future__ import annotations

import hashlib
import threading
from datetime import datetime

from gateway.admin.schemas import (
    Amount,
    CacheUsage,
    KeyOut,
    OperatorOut,
    PrefixOut,
    TenantOut,
    WorkerCache,
)
from gateway.state import GatewayState
from gateway.workers.remote_engine import RemoteEngine
from policies.templates import system_prompt_tokens
from tenancy.api_keys import key_state
from tenancy.models import Admin, ApiKey, PublicPrefix, Tenant, utcnow


def amount(state: GatewayState, blocks: int) -> Amount:
    """`blocks` KV blocks as blocks, tokens and bytes of the served model's KV cache."""
    spec = state.engine.pool.spec
    return Amount(
        blocks=blocks, tokens=blocks * spec.block_size, bytes=blocks * spec.bytes_per_block
    )


def cache_usage(state: GatewayState, tenant: Tenant) -> CacheUsage:
    """The tenant's cache now: in total, and on each engine worker when there are workers."""
    owner = str(tenant.id)
    stats = state.engine.cache_stats().owners.get(owner)
    usage = CacheUsage.of(stats, tenant.cache_quota_blocks, tenant.cache_reservation_blocks)
    if isinstance(state.engine, RemoteEngine):
        for worker, worker_stats in state.engine.worker_stats().items():
            own = worker_stats.owners.get(owner)
            usage.workers.append(
                WorkerCache(
                    worker=worker,
                    active_blocks=own.active_blocks if own else 0,
                    cached_blocks=own.cached_blocks if own else 0,
                    quota_blocks=own.quota_blocks if own else tenant.cache_quota_blocks,
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
        created_at=tenant.created_at,
        quota=amount(state, tenant.cache_quota_blocks),
        reservation=amount(state, tenant.cache_reservation_blocks),
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
    """A registered prefix with the tokens and whole blocks it shares for the served model."""
    tokens = blocks = None
    warning = None
    tokenizer = state.loaded.tokenizer
    if prefix.model == state.model_name and tokenizer is not None:
        tokens = _token_count(tokenizer, prefix.text)
        blocks = tokens // state.settings.block_size
        minimum = state.sharing.min_public_blocks
        if blocks < minimum:
            warning = (
                f"shorter than {minimum} whole blocks ({minimum * state.settings.block_size} "
                "tokens): it will not be shared"
            )
        elif tokens >= state.max_prompt_tokens:
            warning = (
                f"{tokens} tokens, at least the longest prompt this gateway accepts "
                f"({state.max_prompt_tokens}): no request can use it"
            )
    elif prefix.model != state.model_name:
        warning = f"this gateway serves {state.model_name!r}, not {prefix.model!r}"
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


def _token_count(tokenizer: object, text: str) -> int:
    """Tokens of a registered prompt's system turn, remembered by the text's digest: listing
    prefixes must not re-tokenize every text every time."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    with _TOKEN_COUNTS_LOCK:
        count = _TOKEN_COUNTS.get(digest)
    if count is None:
        count = len(system_prompt_tokens(tokenizer, text))
        with _TOKEN_COUNTS_LOCK:
            if len(_TOKEN_COUNTS) >= _TOKEN_COUNTS_KEPT:
                _TOKEN_COUNTS.pop(next(iter(_TOKEN_COUNTS)))
            _TOKEN_COUNTS[digest] = count
    return count


_TOKEN_COUNTS: dict[bytes, int] = {}  # one served model per process: its tokenizer's counts
_TOKEN_COUNTS_KEPT = 1024
_TOKEN_COUNTS_LOCK = threading.Lock()


def operator_out(admin: Admin) -> OperatorOut:
    return OperatorOut(
        id=admin.id,
        username=admin.username,
        role=admin.role,
        tenant_id=admin.tenant_id,
        disabled=admin.disabled,
        locked_until=admin.locked_until,
        created_at=admin.created_at,
    )
