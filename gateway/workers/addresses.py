"""Where the workers are: the `workers` setting's entries, read and resolved.

An entry is `http(s)://host:port` (one worker) or `dns://name:port` (every address the name
resolves to now: a headless Service lists one address per ready pod; reached by https when
worker TLS is configured, gateway/workers/tls.py). Parsing happens before anything starts, so
a bad entry is refused in one line; resolving happens at every poll.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


class WorkerSpecError(ValueError):
    """A `workers` entry that is neither http(s)://host:port nor dns://name:port."""


def parse_worker_spec(spec: str) -> tuple[str, str, int]:
    """(scheme, host, port) of one `workers` entry."""
    parts = urlsplit(spec)
    if parts.scheme not in ("http", "https", "dns") or not parts.hostname:
        raise WorkerSpecError(f"{spec!r}: expected http://host:port or dns://name:port")
    try:
        port = parts.port
    except ValueError as error:
        raise WorkerSpecError(f"{spec!r}: {error}") from None
    if port is None:
        raise WorkerSpecError(f"{spec!r}: the port is missing")
    if parts.path not in ("", "/"):
        raise WorkerSpecError(f"{spec!r}: a worker address has no path")
    return parts.scheme, parts.hostname, port


def resolve(spec: str, dns_scheme: str = "http") -> list[str] | None:
    """Base URLs of the workers `spec` names now: itself, or every address a dns:// name
    resolves to, by `dns_scheme` (None when the resolver fails: the caller keeps what it had)."""
    scheme, host, port = parse_worker_spec(spec)
    if scheme != "dns":
        return [f"{scheme}://{host}:{port}"]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno == socket.EAI_NONAME:
            return []  # the name has no address: no ready worker behind it
        return None
    except OSError:
        return None
    urls = []
    for address in sorted({str(info[4][0]) for info in infos}):
        shown = f"[{address}]" if ":" in address else address
        urls.append(f"{dns_scheme}://{shown}:{port}")
    return urls
