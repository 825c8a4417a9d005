"""`prefixgate certs`: a private CA and certificates for the traffic between gateways and workers.

For a development or compose setup (Kubernetes can take them from cert-manager instead):

    prefixgate certs init --dir certs
    prefixgate certs issue worker --dir certs --server
    prefixgate certs issue gateway --dir certs --client

Keep `ca.key` off every server: only `issue` reads it.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from gateway.cli.common import fail
from gateway.workers.certificates import (
    CA_DAYS,
    CERT_DAYS,
    WORKER_SERVER_NAME,
    CertificateError,
    init_ca,
    issue,
)

certs_app = typer.Typer(
    help="A private CA and certificates for gateway-worker TLS.", no_args_is_help=True
)
DEFAULT_DIR = Path("certs")


class Role(StrEnum):
    server = "server"
    client = "client"
    both = "both"


@certs_app.command("init")
def init(
    directory: Annotated[
        Path, typer.Option("--dir", help="Where the CA is written (created 0700).")
    ] = DEFAULT_DIR,
    force: Annotated[bool, typer.Option(help="Replace a CA already there.")] = False,
) -> None:
    """Make a private CA: ca.pem (give it to every gateway and worker) and ca.key (0600)."""
    try:
        made = init_ca(directory, force=force)
    except (CertificateError, OSError) as error:
        fail(str(error))
    typer.echo(f"CA written: {made.cert} (key {made.key}, valid {CA_DAYS} days)")


@certs_app.command("issue")
def issue_command(
    name: Annotated[str, typer.Argument(help="The certificate's name: NAME.pem and NAME.key.")],
    directory: Annotated[
        Path, typer.Option("--dir", help="The CA's directory; the certificate goes there too.")
    ] = DEFAULT_DIR,
    san: Annotated[
        list[str] | None,
        typer.Option(help="More names it is valid for: DNS:name or IP:address (repeatable)."),
    ] = None,
    server: Annotated[
        bool, typer.Option("--server", help=f"A worker's (valid for {WORKER_SERVER_NAME}).")
    ] = False,
    client: Annotated[bool, typer.Option("--client", help="A gateway's.")] = False,
    role: Annotated[
        Role | None, typer.Option(help="server, client or both (instead of the flags).")
    ] = None,
    days: Annotated[int, typer.Option(help="How long it is valid.")] = CERT_DAYS,
    force: Annotated[bool, typer.Option(help="Replace a certificate already there.")] = False,
) -> None:
    """Issue a certificate signed by the CA: --server for a worker, --client for a gateway."""
    if role is not None and (server or client):
        fail("give --role or --server/--client, not both")
    if role is not None:
        server, client = role in (Role.server, Role.both), role in (Role.client, Role.both)
    if not (server or client):
        fail("say what it is for: --server (a worker), --client (a gateway), or both")
    try:
        made = issue(
            directory, name, san or [], server=server, client=client, force=force, days=days
        )
    except (CertificateError, OSError) as error:
        fail(str(error))
    uses = " and ".join(kind for kind, on in (("server", server), ("client", client)) if on)
    typer.echo(f"certificate written: {made.cert} (key {made.key}; {uses}, valid {days} days)")
