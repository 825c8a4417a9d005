"""`prefixgate worker`: an engine worker for gateways started with `--workers`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.cli.common import app, check_engine_settings, fail, load_settings
from gateway.cli.settings_command import SettingOptionsCommand

DEFAULT_WORKER_PORT = 8001


# Options named after a setting show the default in effect here (SettingOptionsCommand); the
# port is the worker's own, so that a gateway's PREFIXGATE_PORT (one .env for both) is not it.
@app.command(
    cls=SettingOptionsCommand, short_help="Serve one engine to gateways (`serve --workers`)."
)
def worker(
    host: Annotated[str | None, typer.Option(help="Interface to listen on.")] = None,
    port: Annotated[
        int,
        typer.Option(
            help="Port to listen on (the worker API, for gateways only; PREFIXGATE_PORT is "
            "the gateway's and does not apply)."
        ),
    ] = DEFAULT_WORKER_PORT,
    model_dir: Annotated[
        Path | None,
        typer.Option("--model", help="A local model directory (unset: the embedded SmolLM2)."),
    ] = None,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The model id clients send for it (unset: the directory's name)."),
    ] = None,
) -> None:
    """Serve one engine to gateways over mutual TLS (needs PREFIXGATE_WORKER_SECRET,
    PREFIXGATE_WORKER_SIGNING_KEY and PREFIXGATE_WORKER_TLS_CERT/_KEY/_CA; no database).

    Gateways started with `--workers` (or PREFIXGATE_WORKERS) route requests here, for the
    model it announces; workers of several models may serve one gateway. The worker API is
    internal: never expose it to clients.
    """
    overrides: dict[str, Any] = {
        "host": host,
        "port": port,
        "model_dir": model_dir,
        "served_model_name": served_model_name,
    }
    # Settings and secrets first: a mistake is told in a second, before torch and the app import.
    settings = load_settings(**{k: v for k, v in overrides.items() if v is not None})
    import uvicorn

    from gateway.workers.link import SIGNING_KEY_MISSING
    from gateway.workers.tls import WorkerTLSError, worker_tls

    if settings.worker_secret is None:
        fail("a worker needs PREFIXGATE_WORKER_SECRET, the secret its gateways share")
    if settings.worker_signing_key is None:
        fail(SIGNING_KEY_MISSING)
    try:
        tls = worker_tls(settings)
        https = {} if tls is None else tls.server_options()
    except WorkerTLSError as error:
        fail(str(error))
    check_engine_settings(settings, model_dir)
    from gateway.worker_app import create_worker_app

    application = create_worker_app(settings, announce=typer.echo)
    config = uvicorn.Config(
        application,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        log_level="info",
        access_log=False,  # gateways poll every worker each second
        ws="none",
        **https,
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise typer.Exit(1)
