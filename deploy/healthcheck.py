"""The container health check: exit 0 when the server answers, else 1.

The image has no curl, so Docker's HEALTHCHECK runs this with the image's Python. By default
it asks $PREFIXGATE_HEALTHCHECK_URL, else http://127.0.0.1:$PREFIXGATE_PORT/healthz (port 8000
when unset), for a 200; a path argument (`/readyz`) replaces /healthz.

`--tcp` only connects to 127.0.0.1:$PREFIXGATE_PORT. That is a worker's check: a worker
completes a TLS handshake only with a client certificate its CA signed for a gateway, which a
health check does not hold (the worker's own certificate is a server's), so HTTP cannot reach
it. Its port opens once the model has loaded and the engine runs. A worker listens on 8001:
its container sets PREFIXGATE_PORT=8001 for this check (`prefixgate worker` itself takes
--port).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

TIMEOUT_S = 4.0
TCP = "--tcp"


def port(environ: Mapping[str, str]) -> int:
    return int(environ.get("PREFIXGATE_PORT") or "8000")


def health_url(environ: Mapping[str, str], args: Sequence[str]) -> str:
    """The URL to check, from the environment and an optional path argument."""
    configured = environ.get("PREFIXGATE_HEALTHCHECK_URL")
    if configured:
        return configured
    path = args[0] if args else "/healthz"
    return f"http://127.0.0.1:{port(environ)}{path}"


def accepts_connections(environ: Mapping[str, str]) -> int:
    """0 when something accepts a TCP connection on the server's port, else 1."""
    address = ("127.0.0.1", port(environ))
    try:
        with socket.create_connection(address, timeout=TIMEOUT_S):
            return 0
    except OSError as error:
        print(f"unhealthy: tcp {address[0]}:{address[1]}: {error}", file=sys.stderr)
        return 1


def answers_200(url: str) -> int:
    """0 when `url` answers 200, else 1."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except (urllib.error.URLError, OSError, ValueError) as error:  # HTTPError is a URLError
        print(f"unhealthy: {url}: {error}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args == [TCP]:
        return accepts_connections(os.environ)
    return answers_200(health_url(os.environ, args))


if __name__ == "__main__":
    sys.exit(main())
