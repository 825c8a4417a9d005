"""Operator commands: `admins create|list|disable|enable|set-password` (audited changes) and
`db upgrade`.

The console's first operator comes from here (or from `serve --demo`); after that, operators
can be managed from the console as well. Passwords are read from a file or stdin, never from
the command line (where `ps` and shell history would keep them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.cli.common import (
    JsonOption,
    audited_change,
    fail,
    load_settings,
    open_store,
    report,
    report_rows,
)
from tenancy import admins as admin_service
from tenancy import tenants
from tenancy.models import Admin

admins_app = typer.Typer(help="Operator accounts for the admin console.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)

PasswordFileOption = Annotated[
    Path | None, typer.Option(help="Read the password from this file (else stdin).")
]


def admin_json(admin: Admin, tenant_slug: str | None = None) -> dict[str, Any]:
    return {
        "id": str(admin.id),
        "username": admin.username,
        "role": admin.role,
        "tenant": tenant_slug,
        "disabled": admin.disabled,
        "locked_until": admin.locked_until,
        "created_at": admin.created_at,
    }


def read_password(password_file: Path | None) -> str:
    """The new password, from a file, a prompt (twice) or one line of stdin."""
    if password_file is not None:
        try:
            return password_file.read_text().rstrip("\n")
        except OSError as error:
            fail(f"cannot read {password_file}: {error.strerror}")
    if sys.stdin.isatty():
        password: str = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
        return password
    return sys.stdin.readline().rstrip("\n")


@admins_app.command("create")
def admins_create(
    username: Annotated[str, typer.Argument()],
    password_file: PasswordFileOption = None,
    role: Annotated[str, typer.Option(help="admin (every tenant) or tenant-admin.")] = "admin",
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="The tenant (slug) a tenant-admin manages.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Create an operator account for the admin console."""
    password = read_password(password_file)

    def create(session: Any, _: Any) -> dict[str, Any]:
        tenant_id = None if tenant is None else tenants.get_tenant(session, tenant).id
        admin = admin_service.create_admin(session, username, password, role, tenant_id)
        return admin_json(admin, tenant)

    created = audited_change(
        "admin.create",
        "admin",
        username,
        create,
        details={"role": role, "tenant": tenant},
    )
    report(created, as_json, f"created {role} {username}")


@admins_app.command("list")
def admins_list(as_json: JsonOption = False) -> None:
    """List operator accounts."""
    with open_store() as store, store.transaction() as session:
        slugs = {t.id: t.slug for t in tenants.list_tenants(session, include_deleted=True)}
        rows = [
            admin_json(admin, slugs.get(admin.tenant_id) if admin.tenant_id else None)
            for admin in admin_service.list_admins(session)
        ]
    report_rows(rows, as_json, _admin_line)


def _admin_line(row: dict[str, Any]) -> str:
    tenant = f" tenant={row['tenant']}" if row["tenant"] else ""
    state = " disabled" if row["disabled"] else ""
    return f"{row['username']:<24} {row['role']:<12}{tenant}{state}"


@admins_app.command("disable")
def admins_disable(username: str) -> None:
    """Disable an operator (its sessions end at once); one enabled admin always remains."""
    _set_disabled(username, True)
    typer.echo(f"{username}: disabled")


@admins_app.command("enable")
def admins_enable(username: str) -> None:
    """Re-enable a disabled operator."""
    _set_disabled(username, False)
    typer.echo(f"{username}: enabled")


@admins_app.command("set-password")
def admins_set_password(username: str, password_file: PasswordFileOption = None) -> None:
    """Set an operator's password; it also clears a lockout and ends the account's sessions."""
    password = read_password(password_file)
    audited_change(
        "admin.set_password",
        "admin",
        username,
        lambda s, _: admin_json(
            admin_service.change_password(s, admin_service.find_admin(s, username).id, password)
        ),
    )
    typer.echo(f"{username}: password changed")


def _set_disabled(username: str, disabled: bool) -> None:
    audited_change(
        "admin.disable" if disabled else "admin.enable",
        "admin",
        username,
        lambda s, _: admin_json(
            admin_service.set_disabled(s, admin_service.find_admin(s, username).id, disabled)
        ),
    )


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
