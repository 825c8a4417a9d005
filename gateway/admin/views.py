"""Tenancy rows as the admin API shows them, with the running engine's view where it has one."""

from __future__ import annotations

from datetime import datetime

from gateway.admin.schemas import (
    Amount,
    CacheUsage,
    KeyOut,
    OperatorOut,
    PrefixOut,
    TenantOut,
)
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


def tenant_out(state: GatewayState, tenant: Tenant) -> TenantOut:
    stats = state.engine.cache_stats().owners.get(str(tenant.id))
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
        cache=CacheUsage.of(stats, tenant.cache_quota_blocks, tenant.cache_reservation_blocks),
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
        tokens = len(system_prompt_tokens(tokenizer, prefix.text))
        blocks = tokens // state.settings.block_size
        minimum = state.sharing.min_public_blocks
        if blocks < minimum:
            warning = (
                f"shorter than {minimum} whole blocks ({minimum * state.settings.block_size} "
                "tokens): it will not be shared"
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
