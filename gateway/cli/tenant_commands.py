"""Tenant commands: `tenants create|list|show|set-quota|set-sharing|set-weight|suspend|delete`.

Every change runs in one transaction and is audited, whatever its outcome (`audited_change`).
A tenant's second-tier quota and reservation are bytes (`--tier-quota-bytes 512MiB`), or
`default`: for the quota the pool quota's bytes (the engine works them out for its model), for
the reservation none.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer
from sqlalchemy.orm import Session

from gateway.cli.common import (
    JsonOption,
    audited_change,
    fail,
    open_store,
    print_json,
    report,
    report_rows,
)
from tenancy import deployment, tenants
from tenancy.errors import TenancyError
from tenancy.models import SCHEDULING_WEIGHT_RANGE, Tenant
from tenancy.tenants import UNCHANGED, Unchanged

tenants_app = typer.Typer(help="Create and manage tenants.", no_args_is_help=True)
WEIGHT_HELP = (
    "Scheduling weight, 0.01 to 100: against other tenants with work, the tenant's share of "
    "the engine's service is in proportion to it (equal weights share equally)."
)
TIER_QUOTA_HELP = (
    "Bytes in the second KV tier (a number, or with KiB, MiB, GiB or TiB), or `default`: the "
    "pool quota's bytes."
)
TIER_RESERVATION_HELP = (
    "Bytes in the second KV tier no other tenant can evict, at most the tier quota (a number, "
    "or with KiB, MiB, GiB or TiB), or `default`: none."
)
# A plain decimal number with an optional exponent: not Python's float spellings (1_0, " 2",
# nan, inf), which would set a weight nobody meant.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_BYTES = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB|TiB)?")
_UNIT_BYTES = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_weight(text: str | float) -> float:
    """A weight typed on the command line, read strictly; its range is the tenancy's check.

    A default reaches it already a float.
    """
    if isinstance(text, float):
        return text
    if not _DECIMAL.fullmatch(text):
        low, high = (tenants.weight_text(bound) for bound in SCHEDULING_WEIGHT_RANGE)
        raise typer.BadParameter(f"expected a decimal number from {low} to {high} (got {text!r})")
    return float(text)


def parse_tier_bytes(text: str | None, option: str) -> int | Unchanged | None:
    """A tier size typed on the command line: UNCHANGED when not given, None for `default`,
    else whole bytes (a plain number, or one with KiB, MiB, GiB or TiB); one line otherwise."""
    if text is None:
        return UNCHANGED
    if text.strip() == "default":
        return None
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        fail(f"{option}: expected bytes (536870912 or 512MiB) or default, got {text!r}")
    return int(match[1]) * _UNIT_BYTES[match[2]]


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {
        "id": str(tenant.id),
        **tenants.tenant_settings(tenant),
        "created_at": tenant.created_at,
    }


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
        if field.startswith("tier_") and value is None:
            value = "default"
        typer.echo(f"{field:<26} {value}")


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
    scheduling_weight: Annotated[float, typer.Option(help=WEIGHT_HELP, parser=parse_weight)] = 1.0,
    tier_quota_bytes: Annotated[str | None, typer.Option(help=TIER_QUOTA_HELP)] = None,
    tier_reservation_bytes: Annotated[str | None, typer.Option(help=TIER_RESERVATION_HELP)] = None,
    no_public_prefixes: Annotated[
        bool, typer.Option("--no-public-prefixes", help="Never use shared public prefixes.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Create a tenant."""
    tier_quota = _default_if_unset(parse_tier_bytes(tier_quota_bytes, "--tier-quota-bytes"))
    tier_reservation = _default_if_unset(
        parse_tier_bytes(tier_reservation_bytes, "--tier-reservation-bytes")
    )
    limits = tenants.TenantLimits(
        quota, reservation, rpm, tpm, concurrent, scheduling_weight, tier_quota, tier_reservation
    )
    tenant = audited_change(
        "tenant.create",
        "tenant",
        slug,
        lambda s, _: with_pool(
            s, tenants.create_tenant(s, slug, name, sharing, limits, not no_public_prefixes)
        ),
        tenant=slug,
        details={
            "sharing": sharing,
            "quota": quota,
            "reservation": reservation,
            "scheduling_weight": scheduling_weight,
            "tier_quota_bytes": tier_quota,
            "tier_reservation_bytes": tier_reservation,
        },
    )
    report(tenant, as_json, f"created tenant {slug} ({tenant['id']}){pool_note(tenant)}")


def _default_if_unset(value: int | Unchanged | None) -> int | None:
    """A new tenant's tier size: not given is the default."""
    return None if isinstance(value, Unchanged) else value


@tenants_app.command("list")
def tenants_list(
    include_deleted: Annotated[bool, typer.Option("--all", help="Include deleted.")] = False,
    as_json: JsonOption = False,
) -> None:
    """List tenants."""
    with open_store() as store, store.transaction() as session:
        rows = [tenant_json(t) for t in tenants.list_tenants(session, include_deleted)]
    report_rows(rows, as_json, _tenant_line)


def _tenant_line(row: dict[str, Any]) -> str:
    return (
        f"{row['slug']:<24} {row['status']:<10} sharing={row['sharing_mode']:<7} "
        f"quota={row['cache_quota_blocks']} reserved={row['cache_reservation_blocks']} "
        f"weight={tenants.weight_text(row['scheduling_weight'])}"
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
    tier_quota_bytes: Annotated[str | None, typer.Option(help=TIER_QUOTA_HELP)] = None,
    tier_reservation_bytes: Annotated[str | None, typer.Option(help=TIER_RESERVATION_HELP)] = None,
    as_json: JsonOption = False,
) -> None:
    """Change a tenant's cache quota, reservation, tier quota or tier reservation (what is not
    given stays)."""
    tier_quota = parse_tier_bytes(tier_quota_bytes, "--tier-quota-bytes")
    tier_reservation = parse_tier_bytes(tier_reservation_bytes, "--tier-reservation-bytes")
    tier = {
        name: value
        for name, value in (
            ("tier_quota_bytes", tier_quota),
            ("tier_reservation_bytes", tier_reservation),
        )
        if not isinstance(value, Unchanged)
    }
    if quota is None and reservation is None and not tier:
        fail("give --quota, --reservation, --tier-quota-bytes or --tier-reservation-bytes")
    tenant = audited_change(
        "tenant.set_quota",
        "tenant",
        slug,
        lambda s, _: with_pool(s, tenants.set_quota(s, slug, quota, reservation, **tier)),
        tenant=slug,
        details={"quota": quota, "reservation": reservation, **tier},
    )
    report(
        tenant,
        as_json,
        f"{slug}: quota {tenant['cache_quota_blocks']}, "
        f"reserved {tenant['cache_reservation_blocks']}, "
        f"tier quota {_bytes_text(tenant['tier_quota_bytes'])}, "
        f"tier reserved {_bytes_text(tenant['tier_reservation_bytes'])}{pool_note(tenant)}",
    )


def _bytes_text(value: int | None) -> str:
    return "default" if value is None else f"{value} bytes"


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
        tenant=slug,
        details={"sharing": mode},
    )
    report(tenant, as_json, f"{slug}: sharing {mode}")


# A weight is never an option: `-1` and `-inf` reach the weight's own checks and messages.
@tenants_app.command("set-weight", context_settings={"ignore_unknown_options": True})
def tenants_set_weight(
    slug: str,
    weight: Annotated[float, typer.Argument(help=WEIGHT_HELP, parser=parse_weight)],
    as_json: JsonOption = False,
) -> None:
    """Change a tenant's scheduling weight (its next request carries it)."""
    tenant = audited_change(
        "tenant.set_weight",
        "tenant",
        slug,
        lambda s, _: tenant_json(tenants.set_scheduling_weight(s, slug, weight)),
        tenant=slug,
        details={"scheduling_weight": weight},
    )
    weight_shown = tenants.weight_text(tenant["scheduling_weight"])
    report(tenant, as_json, f"{slug}: scheduling weight {weight_shown}")


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
        tenant=slug,
    )
    typer.echo(f"{slug}: {status}")


@tenants_app.command("delete")
def tenants_delete(slug: str) -> None:
    """Delete a tenant, revoke all its keys and shred its data key (its second-tier blocks
    are unreadable at once); its audit trail stays."""
    # Read by the audit event after the change: whether a data key was shredded.
    details: dict[str, Any] = {}

    def delete(session: Session, _: object) -> dict[str, Any]:
        deleted = tenants.delete_tenant(session, slug)
        details["data_key_shredded"] = deleted.data_key_shredded
        return tenant_json(deleted.tenant)

    audited_change("tenant.delete", "tenant", slug, delete, tenant=slug, details=details)
    typer.echo(f"{slug}: deleted")
