"""The `prefixgate` command line: engine, serving, settings, tenancy, audit and policy commands."""

from __future__ import annotations

import os
import sys

import typer

# Typer vendors click and does not re-export its usage errors.
from typer._click.exceptions import NoArgsIsHelpError, UsageError

# Root commands (plan, demo, generate, serve, settings, worker) register themselves on `app` when
# their modules are imported; command groups are mounted below, in the order --help lists them.
from gateway.cli import engine_commands, serve_command, settings_command, worker_command
from gateway.cli.admin_commands import admins_app, db_app
from gateway.cli.audit_commands import audit_app
from gateway.cli.cert_commands import certs_app
from gateway.cli.common import app, one_line
from gateway.cli.key_commands import keys_app
from gateway.cli.prefix_commands import prefixes_app
from gateway.cli.tenant_commands import tenants_app
from tenancy.errors import InvalidInput

__all__ = ["app", "main"]
ROOT_COMMAND_MODULES = (engine_commands, serve_command, settings_command, worker_command)
COMMAND_GROUPS = {
    "audit": audit_app,
    "tenants": tenants_app,
    "keys": keys_app,
    "admins": admins_app,
    "db": db_app,
    "prefixes": prefixes_app,
    "certs": certs_app,
}
for name, group in COMMAND_GROUPS.items():
    app.add_typer(group, name=name)


def main() -> None:
    """Entry point: every failure is one line on stderr and a non-zero exit, never a traceback.

    Usage errors exit 2; anything unexpected exits 1 (PREFIXGATE_DEBUG=1 shows its traceback).
    """
    command = typer.main.get_command(app)
    try:
        result = command.main(prog_name="prefixgate", standalone_mode=False)
    except NoArgsIsHelpError as error:
        error.show()  # a bare group prints its help, as it always has
        sys.exit(error.exit_code)
    except UsageError as error:
        where = f" (see `{error.ctx.command_path} --help`)" if error.ctx is not None else ""
        _error_line(f"{error.format_message().rstrip('.')}{where}")
        sys.exit(error.exit_code)
    except typer.TyperException as error:
        _error_line(error.format_message())
        sys.exit(error.exit_code)
    except InvalidInput as error:  # the tenancy layer's refusal of a value given to it
        _error_line(str(error))
        sys.exit(2)
    except typer.Abort:
        _error_line("aborted")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # the last resort: a bug or an unforeseen failure
        if os.environ.get("PREFIXGATE_DEBUG"):
            raise
        _error_line(f"unexpected {type(error).__name__}: {error} (PREFIXGATE_DEBUG=1 shows more)")
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)


def _error_line(message: str) -> None:
    typer.echo(f"prefixgate: error: {one_line(message)}", err=True)
