"""Audit commands: `audit export`, `audit verify`, `audit flush`, `audit replay-dead-letters`."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from gateway.cli.common import fail, open_store, record_cli_event
from tenancy import tenants
from tenancy.audit_export import ExportFilter, export_events
from tenancy.audit_files import UnreadableAuditFile
from tenancy.audit_replay import ReplayResult, replay_dead_letters
from tenancy.audit_verification import verify_database, verify_file
from tenancy.errors import TenancyError

audit_app = typer.Typer(
    help="Export and verify the tamper-evident audit log.", no_args_is_help=True
)


def parse_time(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"{option}: expected an ISO date or time such as 2026-11-01 or 2026-11-01T12:00")
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@audit_app.command("export")
def audit_export(
    out: Annotated[Path, typer.Option(help="File to write.")],
    file_format: Annotated[str, typer.Option("--format", help="jsonl or csv.")] = "jsonl",
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's events.")] = None,
    since: Annotated[str | None, typer.Option(help="From this time (inclusive).")] = None,
    until: Annotated[str | None, typer.Option(help="Before this time.")] = None,
    action: Annotated[
        str | None,
        typer.Option(help="Only this action, or those starting with a prefix: tenant.*"),
    ] = None,
    outcome: Annotated[
        str | None, typer.Option(help="Only this outcome (success, failure, rejected, ...).")
    ] = None,
) -> None:
    """Export audit events with a signed trailer; the export itself is audited."""
    if file_format not in ("jsonl", "csv"):
        fail(f"--format must be jsonl or csv, got {file_format!r}")
    start, end = parse_time(since, "--since"), parse_time(until, "--until")
    with open_store() as store:
        tenant_id = None
        if tenant is not None:
            with store.transaction() as session:
                try:
                    tenant_id = str(tenants.get_tenant(session, tenant, include_deleted=True).id)
                except TenancyError as error:
                    fail(str(error))
        selection = ExportFilter(tenant_id, start, end, action, outcome)
        store.audit.checkpoint_now()
        try:
            with store.transaction() as session:
                count = export_events(session, selection, out, file_format, store.signing_key)
        except OSError as error:
            fail(f"cannot write {out}: {error.strerror}")
        record_cli_event(
            store,
            "audit.export",
            "success",
            "audit_log",
            tenant_id=tenant_id,
            details={"events": count, "format": file_format, **selection.as_dict()},
        )
    typer.echo(f"exported {count} events to {out}")


@audit_app.command("verify")
def audit_verify(
    file: Annotated[Path | None, typer.Argument(help="An export to check.")] = None,
    database: Annotated[
        bool, typer.Option("--database", help="Check the stored chain instead of a file.")
    ] = False,
) -> None:
    """Check an export (or the database): names the first tampered event.

    Exits 1 only when something was tampered with, 2 when the input cannot be read.
    """
    if (file is None) == (not database):
        fail("give an export FILE or --database")
    with open_store() as store:
        try:
            if file is None:
                with store.transaction() as session:
                    result = verify_database(
                        session, store.signing_key, store.audit.checkpoint_path
                    )
            else:
                result = verify_file(file, store.signing_key)
        except UnreadableAuditFile as error:
            fail(str(error))
    if not result.ok:
        typer.echo(f"prefixgate: audit verification FAILED: {result.problem}", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {result.events} events verified")


@audit_app.command("flush")
def audit_flush() -> None:
    """Write events spooled during a database outage; reports events the database refused."""
    with open_store() as store:
        pending, refused_before = store.audit.pending(), store.audit.dead_letters()
        if not store.audit.flush():
            left = store.audit.pending()
            fail(f"the database is still unreachable; {left} events stay spooled", code=1)
        refused, path = store.audit.dead_letters(), store.audit.dead_letter_path
    typer.echo(f"flushed {pending - (refused - refused_before)} spooled events")
    if refused:
        typer.echo(f"{refused} events the database refused are kept in {path}")


@audit_app.command("replay-dead-letters")
def audit_replay_dead_letters(
    file: Annotated[
        Path | None,
        typer.Option("--file", help="A dead-letter file (default: this host's, in the state dir)."),
    ] = None,
) -> None:
    """Append the events the database refused, after a fix, each exactly once.

    Events still refused, and lines that hold no event, stay in the file; exits 1 then.
    """
    with open_store() as store:
        path = file or store.audit.dead_letter_path
        if file is None and not path.exists():
            typer.echo(f"no dead letters: {path} does not exist")
            return
        with tqdm(desc="replaying", unit="event", file=sys.stderr, disable=None) as bar:

            def show(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            try:
                result = replay_dead_letters(store.audit, path, show)
            except UnreadableAuditFile as error:
                fail(str(error))
            except OSError as error:
                fail(f"cannot replay {path}: {error.strerror}; events replayed so far are stored")
        record_cli_event(
            store,
            "audit.replay_dead_letters",
            "success" if result.complete else "failure",
            "audit_log",
            details={"file": str(path), **replay_counts(result)},
        )
    for failing in result.still_failing:
        typer.echo(
            f"prefixgate: line {failing.line}: event {failing.event_id} still fails: "
            f"{failing.reason}",
            err=True,
        )
    for unreadable in result.unreadable:
        typer.echo(f"prefixgate: line {unreadable.line}: {unreadable.problem}; kept", err=True)
    counts = replay_counts(result)
    summary = (
        f"replayed {counts['replayed']}, already in {counts['already_stored']}, "
        f"still failing {counts['still_failing']}"
    )
    if result.unreadable:
        summary += f", unreadable lines {counts['unreadable_lines']}"
    typer.echo(summary if result.complete else f"{summary}; kept in {path}")
    if not result.complete:
        raise typer.Exit(1)


def replay_counts(result: ReplayResult) -> dict[str, int]:
    return {
        "replayed": result.replayed,
        "already_stored": result.already_stored,
        "still_failing": len(result.still_failing),
        "unreadable_lines": len(result.unreadable),
    }
