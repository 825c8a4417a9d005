"""The root Typer app and what every command shares: one-line errors, JSON, the store."""

from __future__ import annotations

import getpass
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NoReturn

import typer

app = typer.Typer(
    help="PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


@app.callback()
def root() -> None:
    """PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"prefixgate: error: {message}", err=True)
    raise typer.Exit(code)


def parse_duration(text: str, option: str) -> timedelta:
    """`30s`, `15m`, `24h`, `7d`."""
    match = _DURATION.match(text.strip())
    if match is None:
        fail(f"{option}: expected a duration like 30m, 24h or 7d, got {text!r}")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, default=_json_default))


def report(value: Any, as_json: bool, text: str) -> None:
    """A command's result: the JSON object with --json, else a line for people."""
    if as_json:
        print_json(value)
    else:
        typer.echo(text)


def _json_default(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def operator() -> str:
    """Who runs this command, for the audit log."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


@contextmanager
def open_store(check_schema: bool = True) -> Iterator[Any]:
    """The tenancy store from settings, with database errors turned into one-line messages."""
    from sqlalchemy.exc import OperationalError

    from gateway.settings import Settings
    from tenancy.migrate import SchemaOutOfDate

    try:
        store = Settings().open_store(check_schema)
    except SchemaOutOfDate as error:
        fail(str(error))
    except OperationalError as error:
        fail(f"cannot reach the database: {error.orig}")
    try:
        yield store
    finally:
        store.close()
