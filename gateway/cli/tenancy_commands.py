"""Tenancy commands: `tenants`, `keys`, `admins`, `db`. Every change is audited."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from sqlalchemy.orm import Session

from gateway.cli.common import (
    app,
    fail,
    load_settings,
    open_store,
    operator,
    parse_duration,
    print_json,
    report,
)
from tenancy import admins as admin_service
from tenancy import api_keys, deployment, tenants
from tenancy.audit_chain import AuditRecord
from tenancy.errors import TenancyError
from tenancy.models import Admin, ApiKey, Tenant, utcnow
from tenancy.store import Store

T = TypeVar("T")

tenants_app = typer.Typer(help="Create and manage tenants.", no_args_is_help=True)
keys_app = typer.Typer(help="Create, list, revoke and rotate API keys.", no_args_is_help=True)
admins_app = typer.Typer(help="Operator accounts for the admin console.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(admins_app, name="admins")
app.add_typer(db_app, name="db")

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
TenantOption = Annotated[str, typer.Option("--tenant", help="Tenant slug.")]


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": str(tenant.id),
        "slug": tenant.slug,
        "display_name": tenant.display_name,
        "status": tenant.status,
        "sharing_mode": tenant.sharing_mode,
        "may_use_public_prefixes": tenant.may_use_public_prefixes,
        "cache_quota_blocks": tenant.cache_quota_blocks,
        "cache_reservation_blocks": tenant.cache_reservation_blocks,
        "requests_per_minute": tenant.requests_per_minute,
        "tokens_per_minute": tenant.tokens_per_minute,
        "max_concurrent": tenant.max_concurrent,
        "created_at": tenant.created_at,
    }


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


def admin_json(admin: Admin) -> dict[str, Any]:
    return {"id": str(admin.id), "username": admin.username, "role": admin.role,
            "created_at": admin.created_at}  # fmt: skip


def created_key_json(created: api_keys.CreatedKey, owner: Tenant, **extra: str) -> dict[str, Any]:
    """A new key for output: the secret (this once), its row, and the owner's id for audit."""
    return {"key": created.secret, **key_json(created.key, owner), **extra,
            "tenant_id": str(owner.id)}  # fmt: skip


def audited_change(
    action: str,
    resource_type: str,
    resource_id: str,
    change: Callable[[Session, Store], T],
    tenant_of: Callable[[T], str | None] = lambda _: None,
    details: dict[str, Any] | None = None,
) -> T:
    """Run `change` in one transaction and audit its outcome; errors become one line."""
    with open_store() as store:

        def audit(outcome: str, tenant_id: str | None, extra: dict[str, Any]) -> None:
            store.record(
                AuditRecord(
                    actor_type="cli",
                    actor_id=operator(),
                    action=action,
                    outcome=outcome,
                    tenant_id=tenant_id,
                    resource_type=resource_type,
                    resource_id=resource_id,
                    details={**(details or {}), **extra},
                )
            )

        try:
            with store.transaction() as session:
                result = change(session, store)
                tenant_id = tenant_of(result)
        except TenancyError as error:
            audit("failure", None, {"error": str(error)})
            fail(str(error))
        audit("success", tenant_id, {})
        return result


def with_pool(session: Session, tenant: Tenant) -> dict[str, Any]:
    """`tenant` as JSON plus the KV pool its quota was checked against (None: not recorded)."""
    pool = deployment.recorded_pool(session)
    return {**tenant_json(tenant), "pool_blocks": None if pool is None else pool.blocks}


def pool_note(tenant: dict[str, Any]) -> str:
    """What people should know when quotas could not be checked against the pool."""
    if tenant["pool_blocks"] is not None:
        return ""
    return "\nnote: not checked against the KV pool: no server has recorded its size yet"


def show_tenant(tenant: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(tenant)
        return
    for field, value in tenant.items():
        typer.echo(f"{field:<26} {value}")


# -- tenants -----------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(
    slug: Annotated[str, typer.Argument(help="Short unique name: lowercase, digits, dashes.")],
    name: Annotated[str | None, typer.Option(help="Display name.")] = None,
    sharing: Annotated[str, typer.Option(help="user (default) or tenant.")] = "user",
    quota: Annotated[
        int | None, typer.Option(help="Cache quota in KV blocks (default 1024, at most the pool).")
    ] = None,
    reservation: Annotated[int, typer.Option(help="Reserved cache blocks.")] = 0,
    rpm: Annotated[int, typer.Option(help="Requests per minute.")] = 600,
    tpm: Annotated[int, typer.Option(help="Tokens per minute.")] = 1_000_000,
    concurrent: Annotated[int, typer.Option(help="Concurrent requests.")] = 16,
    no_public_prefixes: Annotated[
        bool, typer.Option("--no-public-prefixes", help="Never use shared public prefixes.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Create a tenant."""
    limits = tenants.TenantLimits(quota, reservation, rpm, tpm, concurrent)
    tenant = audited_change(
        "tenant.create",
        "tenant",
        slug,
        lambda s, _: with_pool(
            s, tenants.create_tenant(s, slug, name, sharing, limits, not no_public_prefixes)
        ),
        tenant_of=lambda t: t["id"],
        details={"sharing": sharing, "quota": quota, "reservation": reservation},
    )
    report(tenant, as_json, f"created tenant {slug} ({tenant['id']}){pool_note(tenant)}")


@tenants_app.command("list")
def tenants_list(
    include_deleted: Annotated[bool, typer.Option("--all", help="Include deleted.")] = False,
    as_json: JsonOption = False,
) -> None:
    """List tenants."""
    with open_store() as store, store.transaction() as session:
        rows = [tenant_json(t) for t in tenants.list_tenants(session, include_deleted)]
    if as_json:
        print_json(rows)
        return
    for row in rows:
        typer.echo(
            f"{row['slug']:<24} {row['status']:<10} sharing={row['sharing_mode']:<7} "
            f"quota={row['cache_quota_blocks']} reserved={row['cache_reservation_blocks']}"
        )


@tenants_app.command("show")
def tenants_show(slug: str, as_json: JsonOption = False) -> None:
    """Show one tenant."""
    with open_store() as store, store.transaction() as session:
        try:
            tenant = tenant_json(tenants.get_tenant(session, slug))
        except TenancyError as error:
            fail(str(error))
    show_tenant(tenant, as_json)


@tenants_app.command("set-quota")
def tenants_set_quota(
    slug: str,
    quota: Annotated[int | None, typer.Option(help="Cache quota in KV blocks.")] = None,
    reservation: Annotated[int | None, typer.Option(help="Reserved cache blocks.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Change a tenant's cache quota, reservation or both (what is not given stays)."""
    if quota is None and reservation is None:
        fail("give --quota, --reservation or both")
    tenant = audited_change(
        "tenant.set_quota",
        "tenant",
        slug,
        lambda s, _: with_pool(s, tenants.set_quota(s, slug, quota, reservation)),
        tenant_of=lambda t: t["id"],
        details={"quota": quota, "reservation": reservation},
    )
    report(
        tenant,
        as_json,
        f"{slug}: quota {tenant['cache_quota_blocks']}, "
        f"reserved {tenant['cache_reservation_blocks']}{pool_note(tenant)}",
    )


@tenants_app.command("set-sharing")
def tenants_set_sharing(
    slug: str,
    mode: Annotated[str, typer.Argument(help="user or tenant.")],
    as_json: JsonOption = False,
) -> None:
    """Choose whether private prefixes are shared per user (default) or tenant-wide."""
    tenant = audited_change(
        "tenant.set_sharing",
        "tenant",
        slug,
        lambda s, _: tenant_json(tenants.set_sharing(s, slug, mode)),
        tenant_of=lambda t: t["id"],
        details={"sharing": mode},
    )
    report(tenant, as_json, f"{slug}: sharing {mode}")


@tenants_app.command("suspend")
def tenants_suspend(
    slug: str,
    resume: Annotated[bool, typer.Option("--resume", help="Reactivate instead.")] = False,
) -> None:
    """Suspend a tenant (its keys stop working) or, with --resume, reactivate it."""
    status = "active" if resume else "suspended"
    audited_change(
        "tenant.resume" if resume else "tenant.suspend",
        "tenant",
        slug,
        lambda s, _: tenant_json(tenants.set_status(s, slug, status)),
        tenant_of=lambda t: t["id"],
    )
    typer.echo(f"{slug}: {status}")


@tenants_app.command("delete")
def tenants_delete(slug: str) -> None:
    """Delete a tenant and revoke all its keys (its audit trail stays)."""
    audited_change(
        "tenant.delete",
        "tenant",
        slug,
        lambda s, _: tenant_json(tenants.delete_tenant(s, slug)),
        tenant_of=lambda t: t["id"],
    )
    typer.echo(f"{slug}: deleted")


# -- keys ----------------------------------------------------------------------------------


@keys_app.command("create")
def keys_create(
    tenant: TenantOption,
    name: Annotated[str, typer.Option(help="What the key is for.")] = "default",
    role: Annotated[str, typer.Option(help="inference or tenant-admin.")] = "inference",
    expires: Annotated[str | None, typer.Option(help="Lifetime such as 90d.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Create an API key; the secret is printed this once and never stored."""
    lifetime = parse_duration(expires, "--expires") if expires else None

    def create(session: Session, store: Store) -> dict[str, Any]:
        owner = tenants.get_tenant(session, tenant)
        expires_at = utcnow() + lifetime if lifetime else None
        created = api_keys.create_key(session, owner, name, store.key_secret, role, expires_at)
        return created_key_json(created, owner)

    result = audited_change(
        "key.create", "api_key", f"{tenant}/{name}", create, tenant_of=lambda r: r["tenant_id"],
        details={"role": role},
    )  # fmt: skip
    report(
        result, as_json, f"key id {result['key_id']} for {tenant}; shown only now:\n{result['key']}"
    )


@keys_app.command("list")
def keys_list(tenant: TenantOption, as_json: JsonOption = False) -> None:
    """List a tenant's keys (never their secrets)."""
    with open_store() as store, store.transaction() as session:
        try:
            owner = tenants.get_tenant(session, tenant)
        except TenancyError as error:
            fail(str(error))
        rows = [key_json(key, owner) for key in api_keys.list_keys(session, owner.id)]
    if as_json:
        print_json(rows)
        return
    for row in rows:
        state = "revoked" if row["revoked_at"] else "active"
        typer.echo(f"{row['key_id']}  {row['role']:<12} {state:<8} {row['name']}")


@keys_app.command("revoke")
def keys_revoke(tenant: TenantOption, key_id: Annotated[str, typer.Argument()]) -> None:
    """Revoke a key now."""

    def revoke(session: Session, _: Store) -> str:
        owner = tenants.get_tenant(session, tenant)
        api_keys.revoke_key(session, owner.id, key_id)
        return str(owner.id)

    audited_change("key.revoke", "api_key", key_id, revoke, tenant_of=lambda t: t)
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
        "key.rotate", "api_key", key_id, rotate, tenant_of=lambda r: r["tenant_id"],
        details={"grace": grace},
    )  # fmt: skip
    report(
        result,
        as_json,
        f"new key id {result['key_id']}; {key_id} stops in {grace}:\n{result['key']}",
    )


# -- admins, db ----------------------------------------------------------------------------


@admins_app.command("create")
def admins_create(
    username: Annotated[str, typer.Argument()],
    password_file: Annotated[
        Path | None, typer.Option(help="Read the password from this file (else stdin).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Create an operator account for the admin console."""
    if password_file is not None:
        try:
            password = password_file.read_text().rstrip("\n")
        except OSError as error:
            fail(f"cannot read {password_file}: {error.strerror}")
    elif sys.stdin.isatty():
        password = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    else:
        password = sys.stdin.readline().rstrip("\n")
    created = audited_change(
        "admin.create",
        "admin",
        username,
        lambda s, _: admin_json(admin_service.create_admin(s, username, password)),
    )
    report(created, as_json, f"created admin {username}")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the newest version."""
    from sqlalchemy.exc import OperationalError

    from tenancy.migrate import head_revision, upgrade

    settings = load_settings()
    try:
        upgrade(settings.database_url)
    except OperationalError as error:
        fail(f"cannot reach the database: {error.orig}")
    typer.echo(f"database schema at {head_revision()}")
