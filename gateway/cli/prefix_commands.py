"""Public-prefix commands: `prefixes add|list|enable|disable|delete`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy.orm import Session

from gateway.cli.common import (
    JsonOption,
    audited_change,
    fail,
    load_settings,
    open_store,
    operator,
    report,
    report_rows,
)
from tenancy import prefixes
from tenancy.models import PublicPrefix
from tenancy.store import Store

prefixes_app = typer.Typer(
    help="Admin-registered public system prompts, shared across tenants.", no_args_is_help=True
)

ModelOption = Annotated[str, typer.Option(help="Served model name, e.g. smollm2-135m-instruct.")]
NamespaceOption = Annotated[str, typer.Option(help="Namespace (a cache scope of its own).")]
NameOption = Annotated[str, typer.Option(help="Name of the prefix.")]


def prefix_json(prefix: PublicPrefix) -> dict[str, Any]:
    return {
        "model": prefix.model,
        "namespace": prefix.namespace,
        "name": prefix.name,
        "enabled": prefix.enabled,
        "created_by": prefix.created_by,
        "created_at": prefix.created_at,
        "characters": len(prefix.text),
    }


def allowed_namespaces() -> tuple[str, ...]:
    from policies.config import PolicyFileError, load_policy

    try:
        return load_policy(load_settings().policy_file).namespaces
    except PolicyFileError as error:
        fail(str(error))


@prefixes_app.command("add")
def prefixes_add(
    model: ModelOption,
    namespace: NamespaceOption,
    name: NameOption,
    text_file: Annotated[Path, typer.Option(help="The system prompt as clients send it.")],
    as_json: JsonOption = False,
) -> None:
    """Register a system prompt as public: its KV blocks are shared across tenants."""
    if namespace not in allowed_namespaces():
        fail(f"namespace {namespace!r} is not in the policy's namespaces")
    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        fail(f"cannot read {text_file}: {error}")

    def add(session: Session, _: Store) -> dict[str, Any]:
        created = prefixes.add_prefix(session, model, namespace, name, text, f"cli:{operator()}")
        return prefix_json(created)

    result = audited_change(
        action="prefix.create",
        resource_type="public_prefix",
        resource_id=f"{model}/{namespace}/{name}",
        change=add,
        details={"characters": len(text)},
    )
    report(result, as_json, f"registered {namespace}/{name} for {model} ({len(text)} characters)")


@prefixes_app.command("list")
def prefixes_list(
    model: Annotated[str | None, typer.Option(help="Only this model's prefixes.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List registered public prefixes."""
    with open_store() as store, store.transaction() as session:
        rows = [prefix_json(p) for p in prefixes.list_prefixes(session, model)]
    report_rows(rows, as_json, _prefix_line)


def _prefix_line(row: dict[str, Any]) -> str:
    state = "enabled" if row["enabled"] else "disabled"
    return f"{row['model']}  {row['namespace']}/{row['name']}  {state}"


def _set_enabled(model: str, namespace: str, name: str, enabled: bool) -> None:
    audited_change(
        "prefix.enable" if enabled else "prefix.disable",
        "public_prefix",
        f"{model}/{namespace}/{name}",
        lambda s, _: prefix_json(prefixes.set_enabled(s, model, namespace, name, enabled)),
    )
    typer.echo(f"{namespace}/{name}: {'enabled' if enabled else 'disabled'}")


@prefixes_app.command("enable")
def prefixes_enable(model: ModelOption, namespace: NamespaceOption, name: NameOption) -> None:
    """Share a disabled prefix again."""
    _set_enabled(model, namespace, name, True)


@prefixes_app.command("disable")
def prefixes_disable(model: ModelOption, namespace: NamespaceOption, name: NameOption) -> None:
    """Stop sharing a prefix (requests with it become private) without deleting it."""
    _set_enabled(model, namespace, name, False)


@prefixes_app.command("delete")
def prefixes_delete(model: ModelOption, namespace: NamespaceOption, name: NameOption) -> None:
    """Remove a prefix from the registry and shred its data key (its second-tier blocks are
    unreadable at once)."""
    # Read by the audit event after the change: whether a data key was shredded.
    details: dict[str, Any] = {}

    def delete(session: Session, _: Store) -> None:
        details["data_key_shredded"] = prefixes.delete_prefix(session, model, namespace, name)

    audited_change(
        "prefix.delete", "public_prefix", f"{model}/{namespace}/{name}", delete, details=details
    )
    typer.echo(f"deleted {namespace}/{name}")
