"""The container health check: exit 0 when the server's health endpoint answers 200, else 1.

The image has no curl, so Docker's HEALTHCHECK runs this with the image's Python. The URL is
$PREFIXGATE_HEALTHCHECK_URL, else http://127.0.0.1:$PREFIXGATE_PORT/healthz (port 8000 when
unset); a path argument (`/readyz`) replaces /healthz. A worker listens on 8001: its
container sets PREFIXGATE_PORT=8001 for this check (`prefixgate worker` itself takes --port).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

TIMEOUT_S = 4.0


def health_url(environ: Mapping[str, str], args: Sequence[str]) -> str:
    """The URL to check, from the environment and an optional path argument."""
    configured = environ.get("PREFIXGATE_HEALTHCHECK_URL")
    if configured:
        return configured
    port = environ.get("PREFIXGATE_PORT") or "8000"
    path = args[0] if args else "/healthz"
    return f"http://127.0.0.1:{port}{path}"


def main() -> int:
    url = health_url(os.environ, sys.argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())
