"""The root Typer app and what every command shares: one-line errors, JSON, the store, and
the audited change every admin command makes."""

from __future__ import annotations

import getpass
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from tenancy import tenants
from tenancy.audit_chain import AuditRecord
from tenancy.errors import TenancyError

if TYPE_CHECKING:
    from pathlib import Path

    from pydantic import ValidationError
    from sqlalchemy.orm import Session

    from gateway.settings import Settings
    from tenancy.store import Store

T = TypeVar("T")

app = typer.Typer(
    help="PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def print_version(requested: bool) -> None:
    """`--version`: the installed package's version, then exit before any command runs."""
    if requested:
        typer.echo(f"prefixgate {version('prefixgate')}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache."""


def one_line(text: str) -> str:
    """`text` with its line breaks and runs of spaces folded (drivers' messages span lines)."""
    return " ".join(text.split())


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"prefixgate: error: {one_line(message)}", err=True)
    raise typer.Exit(code)


def parse_duration(text: str, option: str) -> timedelta:
    """`30s`, `15m`, `24h`, `7d`: a duration that still ends before the calendar does."""
    match = _DURATION.match(text.strip())
    if match is None:
        fail(f"{option}: expected a duration like 30m, 24h or 7d, got {text!r}")
    try:
        duration = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        datetime.now(UTC) + duration  # callers add it to now: it must fit in a datetime
    except OverflowError:
        fail(f"{option}: {text} is too long")
    return duration


def load_settings(**overrides: Any) -> Settings:
    """Settings from PREFIXGATE_* and .env (plus `overrides`); a bad value is one line."""
    from pydantic import ValidationError

    from gateway.settings import Settings

    try:
        return Settings(**overrides)
    except ValidationError as error:
        where, reason = setting_problems(error)[0]
        fail(f"setting {where}: {reason}" if where else f"settings: {reason}")
    except UnicodeDecodeError as error:
        env_file_unreadable(error)


def log_to_state_dir(settings: Settings) -> Path:
    """Send this command's log (the engine's notes: its warm-up, threads given up while the CPUs
    are busy) to `<state_dir>/prefixgate.log`, never into the command's output; its path."""
    import logging

    from tenancy.private_paths import create_private_file

    path = settings.state_dir / "prefixgate.log"
    create_private_file(path)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def env_file_unreadable(error: UnicodeDecodeError) -> NoReturn:
    """The one line for a .env that is not text (the only bytes settings decode are .env's)."""
    fail(f"cannot read .env in the working directory: not UTF-8 text at byte {error.start}")


def setting_problems(error: ValidationError) -> list[tuple[str, str]]:
    """What the settings' validation refused: each problem's setting (dotted, empty for a rule
    across settings) and its reason."""
    return [
        (
            ".".join(map(str, problem["loc"])),
            str(problem.get("ctx", {}).get("error") or problem["msg"]),
        )
        for problem in error.errors()
    ]


def check_engine_settings(settings: Settings, model: Path | None) -> None:
    """Refuse a model option that is not a model directory, or an engine this machine cannot
    run, in one line, before anything loads."""
    from gateway.runtime.engine_setup import check_engine

    if model is not None and not (model / "config.json").is_file():
        fail(f"{model} is not a model directory (no config.json)")
    try:
        check_engine(settings)
    except ValueError as error:
        fail(str(error))


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, default=_json_default))


def report(value: Any, as_json: bool, text: str) -> None:
    """A command's result: the JSON object with --json, else a line for people."""
    if as_json:
        print_json(value)
    else:
        typer.echo(text)


def report_rows(
    rows: list[dict[str, Any]], as_json: bool, line: Callable[[dict[str, Any]], str]
) -> None:
    """A listing: the JSON array with --json, else one `line(row)` per row for people."""
    if as_json:
        print_json(rows)
        return
    for row in rows:
        typer.echo(line(row))


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
def open_store(check_schema: bool = True) -> Iterator[Store]:
    """The tenancy store from settings, with database errors turned into one-line messages."""
    store = opened_store(load_settings(), check_schema)
    try:
        yield store
    finally:
        store.close()


def opened_store(settings: Settings, check_schema: bool = True) -> Store:
    """`settings.open_store()`, or one line saying why it cannot be used and exit."""
    from sqlalchemy.exc import OperationalError

    from tenancy.deployment import SecretMismatch
    from tenancy.migrate import SchemaOutOfDate

    try:
        return settings.open_store(check_schema)
    except (SchemaOutOfDate, SecretMismatch) as error:
        fail(str(error))
    except OperationalError as error:
        fail(f"cannot reach the database: {error.orig}")


def audited_change(
    action: str,
    resource_type: str,
    resource_id: str,
    change: Callable[[Session, Store], T],
    tenant: str | None = None,
    details: dict[str, Any] | None = None,
) -> T:
    """Run `change` in one transaction and audit its outcome; errors become one line.

    `tenant` is the slug of the tenant the command is about: whatever the outcome, its event
    carries that tenant's id when the tenant exists, so a refusal is in the tenant's trail too.
    """
    with open_store() as store:

        def audit(outcome: str, extra: dict[str, Any]) -> None:
            record_cli_event(
                store,
                action,
                outcome,
                resource_type,
                resource_id,
                tenant_id=tenant_id_of(store, tenant),
                details={**(details or {}), **extra},
            )

        try:
            with store.transaction() as session:
                result = change(session, store)
        except TenancyError as error:
            audit("failure", {"error": str(error)})
            fail(str(error))
        audit("success", {})
        return result


def record_cli_event(
    store: Store,
    action: str,
    outcome: str,
    resource_type: str,
    resource_id: str | None = None,
    *,
    tenant_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """Audit something a command did, as the operator who ran it."""
    store.record(
        AuditRecord(
            actor_type="cli",
            actor_id=operator(),
            action=action,
            outcome=outcome,
            tenant_id=tenant_id,
            resource_type=resource_type,
            resource_id=resource_id,
            details=details or {},
        )
    )


def tenant_id_of(store: Store, slug: str | None) -> str | None:
    """The id of the tenant called `slug` (a deleted one too), or None if there is none.

    Read after the change committed or rolled back: a tenant just created has its id, and
    one a failed change named but never reached still has its own.
    """
    if slug is None:
        return None
    with store.transaction() as session:
        try:
            return str(tenants.get_tenant(session, slug, include_deleted=True).id)
        except TenancyError:
            return None
