"""Operator commands: `admins create` (an audited change) and `db upgrade`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.cli.common import JsonOption, audited_change, fail, load_settings, report
from tenancy import admins as admin_service
from tenancy.models import Admin

admins_app = typer.Typer(help="Operator accounts for the admin console.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)


def admin_json(admin: Admin) -> dict[str, Any]:
    return {"id": str(admin.id), "username": admin.username, "role": admin.role,
            "created_at": admin.created_at}  # fmt: skip


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
