"""The `prefixgate` command line: engine, tenancy, audit and policy commands."""

from __future__ import annotations

import sys

# Importing the command modules registers their commands on `app`.
from gateway.cli import (
    audit_commands,
    engine_commands,
    policy_commands,
    serve_command,
    tenancy_commands,
)
from gateway.cli.common import app

__all__ = ["app", "main"]
COMMAND_MODULES = (
    audit_commands,
    engine_commands,
    policy_commands,
    serve_command,
    tenancy_commands,
)


def main() -> None:
    """Entry point: click's usage errors as they are, never a traceback."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
