"""Mutual TLS between gateways and engine workers: what each side loads, and the refusal to
start without it.

A worker serves HTTPS and asks every client for a certificate its CA signed
(`ssl.CERT_REQUIRED`): a caller without one never reaches HTTP, let alone the worker secret
check. A gateway presents its client certificate and accepts only a worker whose certificate
the same CA signed, for the fixed name `WORKER_SERVER_NAME`: gateways dial workers by address
(a `dns://` name resolves to pod addresses nobody knows when certificates are issued), so
the name checked is the role, not the address. One `ssl.SSLContext` per gateway, built once,
serves every connection to every worker (polls, model fetches, requests).

Plain HTTP is an explicit choice (`worker_plaintext`, for one machine or a test): without
certificates and without it, neither a worker nor a routing gateway starts.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.settings import Settings
from gateway.workers.certificates import WORKER_SERVER_NAME

PLAINTEXT_REFUSED = (
    "traffic between gateways and workers needs TLS: set PREFIXGATE_WORKER_TLS_CERT, "
    "PREFIXGATE_WORKER_TLS_KEY and PREFIXGATE_WORKER_TLS_CA (`prefixgate certs init` and "
    "`prefixgate certs issue`), or PREFIXGATE_WORKER_PLAINTEXT=true on one machine only"
)


class WorkerTLSError(ValueError):
    """Certificates that cannot be used, or none where they are required (one line)."""


@dataclass(frozen=True, slots=True)
class WorkerTLS:
    """This process's certificate, its key, and the CA of every gateway and worker."""

    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        """A gateway's context: it presents `cert` and accepts only a worker that the CA
        signed for `WORKER_SERVER_NAME`, whatever address it was dialled at."""
        context = _PinnedNameContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=self.ca)
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as error:
            raise WorkerTLSError(f"cannot load the worker TLS files: {error}") from None
        return context

    def server_options(self) -> dict[str, Any]:
        """uvicorn.Config's options for a worker: HTTPS, and a client certificate required."""
        self.server_context()  # unreadable files stop us here, in one line
        return {
            "ssl_certfile": str(self.cert),
            "ssl_keyfile": str(self.key),
            "ssl_ca_certs": str(self.ca),
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
        }

    def server_context(self) -> ssl.SSLContext:
        """What uvicorn builds from `server_options` (to check the files before it starts)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_cert_chain(self.cert, self.key)
            context.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as error:
            raise WorkerTLSError(f"cannot load the worker TLS files: {error}") from None
        return context


class _PinnedNameContext(ssl.SSLContext):
    """A client context that checks every server against `WORKER_SERVER_NAME` (and sends it
    as SNI), not against the address the connection was made to. Both ways a connection can
    be wrapped (a socket: httpx's sync client; memory BIOs: its async one) go through here."""

    def wrap_socket(
        self,
        sock: Any,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        return super().wrap_socket(
            sock,
            server_side=server_side,
            do_handshake_on_connect=do_handshake_on_connect,
            suppress_ragged_eofs=suppress_ragged_eofs,
            server_hostname=WORKER_SERVER_NAME,
            session=session,
        )

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return super().wrap_bio(
            incoming,
            outgoing,
            server_side=server_side,
            server_hostname=WORKER_SERVER_NAME,
            session=session,
        )


def worker_tls(settings: Settings) -> WorkerTLS | None:
    """The TLS these settings configure for worker traffic; None only where plain HTTP was
    chosen explicitly (`worker_plaintext`). Raises `WorkerTLSError` (the line to show) when
    neither is set."""
    if settings.worker_tls_cert is None or settings.worker_tls_key is None:
        if settings.worker_plaintext:
            return None
        raise WorkerTLSError(PLAINTEXT_REFUSED)
    assert settings.worker_tls_ca is not None  # the settings take all three or none
    return WorkerTLS(settings.worker_tls_cert, settings.worker_tls_key, settings.worker_tls_ca)


def scheme(tls: WorkerTLS | None) -> str:
    """The URL scheme workers are reached by."""
    return "http" if tls is None else "https"
