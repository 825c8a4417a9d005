"""The `prefixgate` command line: engine, tenancy, audit and policy commands."""

from __future__ import annotations

import sys

from gateway.cli import audit_commands, engine_commands, tenancy_commands
from gateway.cli.common import app

__all__ = ["app", "audit_commands", "engine_commands", "main", "tenancy_commands"]


def main() -> None:
    """Entry point: click's usage errors as they are, never a traceback."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
