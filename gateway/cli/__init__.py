"""The `prefixgate` command line: engine, tenancy, audit and policy commands."""

from __future__ import annotations

import os
import sys

import typer

# Typer vendors click and does not re-export its usage errors.
from typer._click.exceptions import NoArgsIsHelpError, UsageError

# Importing the command modules registers their commands on `app`.
from gateway.cli import (
    audit_commands,
    engine_commands,
    policy_commands,
    serve_command,
    tenancy_commands,
)
from gateway.cli.common import app, one_line

__all__ = ["app", "main"]
COMMAND_MODULES = (
    audit_commands,
    engine_commands,
    policy_commands,
    serve_command,
    tenancy_commands,
)


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
