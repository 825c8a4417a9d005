"""Operator commands: `admins create|list|disable|enable|set-password|enrol-totp|reset-totp`
(audited changes) and `db upgrade`.

The console's first operator comes from here (or from `serve --demo`); after that, operators
can be managed from the console as well. Passwords are read from a file or stdin, never from
the command line (where `ps` and shell history would keep them). The host can enrol an
operator's TOTP second factor (the way in for an admin where `admin_totp_required` is set)
and reset a lost one; operators enrol their own from the console or the admin API too.
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
from tenancy import tenants, totp
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
        "second_factor": admin.totp_secret is not None,
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
        "operator.create",
        "operator",
        username,
        create,
        tenant=tenant,
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
    state += " totp" if row["second_factor"] else ""
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
    """Set an operator's password; it also ends the account's sessions."""
    password = read_password(password_file)
    audited_change(
        "operator.set_password",
        "operator",
        username,
        lambda s, _: admin_json(
            admin_service.change_password(s, admin_service.find_admin(s, username).id, password)
        ),
    )
    typer.echo(f"{username}: password changed")


@admins_app.command("enrol-totp")
def admins_enrol_totp(username: str) -> None:
    """Enrol a TOTP second factor for an operator: shows its secret once, then asks for a
    code from the authenticator app to confirm it."""
    cipher = _totp_cipher()

    def begin(session: Any, _: Any) -> tuple[str, str]:
        admin = admin_service.find_admin(session, username)
        secret = totp.begin_enrolment(session, admin, cipher)
        return secret, totp.provisioning_uri(secret, admin.username)

    secret, uri = audited_change("operator.totp_begin", "operator", username, begin)
    typer.echo(f"add this to the operator's authenticator app:\n  {uri}\n  secret: {secret}")
    if sys.stdin.isatty():
        code: str = typer.prompt("Code the app shows now")
    else:
        code = sys.stdin.readline().strip()

    def confirm(session: Any, _: Any) -> None:
        admin = admin_service.find_admin(session, username)
        totp.confirm_enrolment(session, admin, code, cipher)

    audited_change("operator.totp_enable", "operator", username, confirm)
    typer.echo(f"{username}: second factor enrolled")


@admins_app.command("reset-totp")
def admins_reset_totp(username: str) -> None:
    """Remove an operator's TOTP second factor (a lost phone): it logs in with its password
    until it enrols again (an admin cannot, where admin_totp_required is set)."""

    def reset(session: Any, _: Any) -> bool:
        return totp.remove(session, admin_service.find_admin(session, username))

    had = audited_change("operator.totp_reset", "operator", username, reset)
    typer.echo(f"{username}: second factor removed" if had else f"{username}: had no second factor")


def _totp_cipher() -> totp.TotpCipher:
    """The cipher the gateways keep second factors under (from the key-hashing secret)."""
    return totp.TotpCipher.from_secret(load_settings().secret("key_hash_secret"))


def _set_disabled(username: str, disabled: bool) -> None:
    audited_change(
        "operator.disable" if disabled else "operator.enable",
        "operator",
        username,
        lambda s, _: admin_json(
            admin_service.set_disabled(s, admin_service.find_admin(s, username).id, disabled)
        ),
    )


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the newest version."""
    from sqlalchemy.exc import OperationalError

    from gateway.settings import without_credentials
    from tenancy.migrate import head_revision, upgrade

    settings = load_settings()
    try:
        upgrade(settings.database_url)
    except OperationalError as error:
        fail(f"cannot reach the database: {error.orig}")
    database = without_credentials(settings.database_url)
    typer.echo(f"database schema at {head_revision()} ({database})")
