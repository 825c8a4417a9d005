"""`prefixgate serve`: the OpenAI-compatible gateway under uvicorn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.cli.common import app, check_engine_settings, fail, load_settings, opened_store
from gateway.cli.settings_command import SettingOptionsCommand

DEMO_TENANT = "demo"
DEMO_ADMIN = "admin"


# Options named after a setting show the default in effect here (SettingOptionsCommand).
@app.command(cls=SettingOptionsCommand, short_help="Serve the OpenAI-compatible API.")
def serve(
    host: Annotated[str | None, typer.Option(help="Interface to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    model_dir: Annotated[
        Path | None,
        typer.Option("--model", help="A local model directory (unset: the embedded SmolLM2)."),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients use (unset: the directory name).")
    ] = None,
    workers: Annotated[
        str | None,
        typer.Option(
            help="Route to engine workers instead of running the engine here: "
            "https://host:port,... or dns://NAME:PORT (mutual TLS: needs the worker secret, "
            "signing key and PREFIXGATE_WORKER_TLS_* files).",
        ),
    ] = None,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help="Create a demo tenant and, if there is no operator yet, a console admin; "
            "print their secrets once.",
        ),
    ] = False,
) -> None:
    """Serve the OpenAI-compatible API (settings from PREFIXGATE_* and .env).

    Every setting is a PREFIXGATE_* environment variable (or a line in .env); the options
    below override the most used ones. `prefixgate settings` lists them all with the values
    in effect and their defaults.
    """
    overrides: dict[str, Any] = {
        "host": host,
        "port": port,
        "model_dir": model_dir,
        "served_model_name": served_model_name,
        "workers": workers,
    }
    # Settings first: a mistaken one is told in a second, before torch and the app import.
    settings = load_settings(**{k: v for k, v in overrides.items() if v is not None})
    import uvicorn

    from gateway.app import create_app, prepare_database
    from gateway.http.connections import InvalidTrustedProxy, uvicorn_config
    from gateway.runtime.engine_setup import check_workers
    from policies.config import PolicyFileError, load_policy

    try:
        load_policy(settings.policy_file)
    except PolicyFileError as error:
        fail(str(error))
    check_engine_settings(settings, model_dir)
    try:
        check_workers(settings)
    except ValueError as error:
        fail(str(error))
    from sqlalchemy.exc import OperationalError

    from tenancy.migrate import SchemaOutOfDate

    try:  # a brand-new database gets its schema; one that is behind stops us here
        prepare_database(settings, typer.echo, first_steps=not demo)
    except SchemaOutOfDate as error:
        fail(str(error))
    except OperationalError as error:
        fail(f"cannot reach the database: {error.orig}")
    if settings.workers:
        _wait_for_a_worker(settings)
    # Secrets that are not the deployment's stop us here too, in one line, before the model
    # loads (the server's own start-up would refuse them as well, less readably).
    opened_store(settings).close()
    application = create_app(settings, on_ready=_prepare_demo if demo else None)
    try:
        config = uvicorn_config(application, settings, log_level="info")
    except InvalidTrustedProxy as error:
        fail(str(error))
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise typer.Exit(1)


def _wait_for_a_worker(settings: Any) -> None:
    """Before anything starts: a worker answers (with the secret), or one line says why not."""
    from gateway.workers.link import worker_link
    from gateway.workers.membership import WorkerSet

    probe = WorkerSet(
        settings.workers,
        worker_link(settings),
        settings.worker_poll_s,
        settings.worker_timeout_s,
        load_models=False,
    )
    probe.start()
    try:
        if not probe.wait_for_any(settings.worker_start_timeout_s):
            wait_s = settings.worker_start_timeout_s
            fail(f"no engine worker answered within {wait_s:g} s ({probe.why_none()})")
    finally:
        probe.stop()


def _prepare_demo(state: Any) -> None:
    _create_demo_tenant(state)
    _create_demo_admin(state)


def _create_demo_admin(state: Any) -> None:
    """A first console operator with a generated password, unless operators exist already."""
    import secrets

    from tenancy import admins
    from tenancy.audit_chain import AuditRecord

    store = state.store
    password = secrets.token_urlsafe(15)
    with store.transaction() as session:
        if admins.list_admins(session):
            return
        admins.create_admin(session, DEMO_ADMIN, password)
    store.record(
        AuditRecord(
            actor_type="cli",
            action="operator.create",
            outcome="success",
            actor_id="serve --demo",
            resource_type="operator",
            resource_id=DEMO_ADMIN,
        )
    )
    console = f"{_client_base(state.settings)}/admin"
    typer.echo(
        f"console: {console}  user {DEMO_ADMIN}, password (shown only now): {password}\n"
        f"  change it on the console's My account page, or with "
        f"`prefixgate admins set-password {DEMO_ADMIN}`"
    )


def _client_base(settings: Any) -> str:
    """The address a client on this machine uses: a wildcard listen address (0.0.0.0, ::)
    is where the server listens, not where a client connects."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(settings.host)
    if host is None:
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def _create_demo_tenant(state: Any) -> None:
    from tenancy import api_keys, tenants
    from tenancy.audit_chain import AuditRecord
    from tenancy.errors import NotFound

    store = state.store
    with store.transaction() as session:
        try:
            tenants.get_tenant(session, DEMO_TENANT)
            exists = True
        except NotFound:
            exists = False
        if exists:
            typer.echo(
                f"demo tenant exists; make another key with "
                f"`prefixgate keys create --tenant {DEMO_TENANT}`"
            )
            return
        tenant = tenants.create_tenant(session, DEMO_TENANT, "Demo tenant")
        created = api_keys.create_key(session, tenant, "demo", store.key_secret)
    store.record(
        AuditRecord(
            actor_type="cli",
            action="tenant.create",
            outcome="success",
            actor_id="serve --demo",
            tenant_id=str(tenant.id),
            resource_type="tenant",
            resource_id=DEMO_TENANT,
        )
    )
    url = f"{_client_base(state.settings)}/v1"
    typer.echo(f"demo tenant created; its API key (shown only now):\n  {created.secret}")
    models = " or ".join(state.models.names())
    typer.echo(f"try: OPENAI_BASE_URL={url} OPENAI_API_KEY=<key> with model {models}")
