"""API key commands: `keys create|list|revoke|rotate`. Every change is audited."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

import typer
from sqlalchemy.orm import Session

from gateway.cli.common import (
    JsonOption,
    audited_change,
    fail,
    open_store,
    parse_duration,
    report,
    report_rows,
)
from tenancy import api_keys, tenants
from tenancy.errors import TenancyError
from tenancy.models import ApiKey, Tenant, utcnow
from tenancy.store import Store

keys_app = typer.Typer(help="Create, list, revoke and rotate API keys.", no_args_is_help=True)

TenantOption = Annotated[str, typer.Option("--tenant", help="Tenant slug.")]


def key_json(key: ApiKey, tenant: Tenant) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "tenant": tenant.slug,
        "name": key.name,
        "role": key.role,
        "created_at": key.created_at,
        "last_used_at": key.last_used_at,
        "expires_at": key.expires_at,
        "revoked_at": key.revoked_at,
        "grace_until": key.grace_until,
    }


def created_key_json(created: api_keys.CreatedKey, owner: Tenant, **extra: str) -> dict[str, Any]:
    """A new key for output: the secret (this once), its row, and the owner's id."""
    return {
        "key": created.secret,
        **key_json(created.key, owner),
        **extra,
        "tenant_id": str(owner.id),
    }


@keys_app.command("create")
def keys_create(
    tenant: TenantOption,
    name: Annotated[str, typer.Option(help="What the key is for.")] = "default",
    role: Annotated[str, typer.Option(help="inference or tenant-admin.")] = "inference",
    expires: Annotated[str | None, typer.Option(help="Lifetime such as 90d.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Create an API key; the secret is printed this once and never stored."""
    lifetime = _lifetime(expires)

    def create(session: Session, store: Store) -> dict[str, Any]:
        owner = tenants.get_tenant(session, tenant)
        expires_at = utcnow() + lifetime if lifetime is not None else None
        created = api_keys.create_key(session, owner, name, store.key_secret, role, expires_at)
        return created_key_json(created, owner)

    result = audited_change(
        action="api_key.create",
        resource_type="api_key",
        resource_id=f"{tenant}/{name}",
        change=create,
        tenant=tenant,
        details={"role": role},
    )
    report(
        result, as_json, f"key id {result['key_id']} for {tenant}; shown only now:\n{result['key']}"
    )


def _lifetime(expires: str | None) -> timedelta | None:
    """`--expires` as a duration; a key that would expire as it is made is refused."""
    if expires is None:
        return None
    lifetime = parse_duration(expires, "--expires")
    if lifetime <= timedelta(0):
        fail(f"--expires: a key's lifetime must be longer than zero, got {expires!r}")
    return lifetime


@keys_app.command("list")
def keys_list(tenant: TenantOption, as_json: JsonOption = False) -> None:
    """List a tenant's keys (never their secrets)."""
    with open_store() as store, store.transaction() as session:
        try:
            owner = tenants.get_tenant(session, tenant)
        except TenancyError as error:
            fail(str(error))
        now = utcnow()
        rows = [
            {**key_json(key, owner), "state": api_keys.key_state(key, now)}
            for key in api_keys.list_keys(session, owner.id)
        ]
    report_rows(rows, as_json, _key_line)


def _key_line(row: dict[str, Any]) -> str:
    return f"{row['key_id']}  {row['role']:<12} {row['state']:<8} {row['name']}"


@keys_app.command("revoke")
def keys_revoke(tenant: TenantOption, key_id: Annotated[str, typer.Argument()]) -> None:
    """Revoke a key now."""

    def revoke(session: Session, _: Store) -> None:
        api_keys.revoke_key(session, tenants.get_tenant(session, tenant).id, key_id)

    audited_change("api_key.revoke", "api_key", key_id, revoke, tenant=tenant)
    typer.echo(f"revoked {key_id}")


@keys_app.command("rotate")
def keys_rotate(
    tenant: TenantOption,
    key_id: Annotated[str, typer.Argument()],
    grace: Annotated[str, typer.Option(help="How long the old key keeps working.")] = "24h",
    as_json: JsonOption = False,
) -> None:
    """Issue a successor key; the old one works until the grace period ends."""
    grace_period: timedelta = parse_duration(grace, "--grace")

    def rotate(session: Session, store: Store) -> dict[str, Any]:
        owner = tenants.get_tenant(session, tenant)
        created = api_keys.rotate_key(session, owner, key_id, store.key_secret, grace_period)
        return created_key_json(created, owner, rotated_from=key_id)

    result = audited_change(
        action="api_key.rotate",
        resource_type="api_key",
        resource_id=key_id,
        change=rotate,
        tenant=tenant,
        details={"grace": grace},
    )
    report(
        result,
        as_json,
        f"new key id {result['key_id']}; {key_id} stops in {grace}:\n{result['key']}",
    )
