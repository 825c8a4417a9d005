"""How a gateway reaches its workers: the URL scheme, one TLS context, the shared secret (a
bearer header), the request signer and the digest workers publish their block keys under
(key_log.py), built once from the settings and shared by every client that talks to workers
(polls and admin actions, model fetches, requests)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.settings import Settings
from gateway.workers.addresses import WorkerSpecError, parse_worker_spec
from gateway.workers.key_log import KeyDigest
from gateway.workers.signing import SIGNATURE_HEADER, RequestSigner, action_view
from gateway.workers.tls import WorkerTLS, scheme, worker_tls

SIGNING_KEY_MISSING = (
    "traffic between gateways and workers needs PREFIXGATE_WORKER_SIGNING_KEY (at least 32 "
    "characters, the same on every gateway and worker)"
)


@dataclass(frozen=True)
class WorkerLink:
    """A gateway's way to its workers."""

    secret: str
    signer: RequestSigner
    digest: KeyDigest  # how workers publish their block keys (key_log.py), for routing
    tls: WorkerTLS | None  # None: plain HTTP, chosen explicitly
    _context: ssl.SSLContext | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return scheme(self.tls)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def verify(self) -> ssl.SSLContext | bool:
        """What httpx's `verify` takes: the one TLS context (plain HTTP: unused)."""
        return self._context if self._context is not None else True

    def sync_client(self, timeout_s: float) -> httpx.Client:
        return httpx.Client(headers=self.headers, timeout=timeout_s, verify=self.verify())

    def async_client(self, **options: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(verify=self.verify(), **options)

    @classmethod
    def create(cls, secret: str, signing_key: str, tls: WorkerTLS | None) -> WorkerLink:
        """The link with these secrets; its TLS context is built (and its files read) now."""
        context = None if tls is None else tls.client_context()
        return cls(secret, RequestSigner(signing_key), KeyDigest(signing_key), tls, context)

    def signed(self, action: str, body: dict[str, Any] | None) -> dict[str, str]:
        """The signature header of an admin action with this body."""
        return {SIGNATURE_HEADER: self.signer.sign(action_view(action, body))}


def worker_link(settings: Settings) -> WorkerLink:
    """The link these settings describe; ValueError (one line to show) when something is
    missing: the secret, the signing key, or TLS (unless plain HTTP was chosen), or when a
    worker address's scheme does not match (https:// with TLS, http:// without)."""
    if settings.worker_secret is None:
        raise ValueError("routing to workers needs PREFIXGATE_WORKER_SECRET")
    if settings.worker_signing_key is None:
        raise ValueError(SIGNING_KEY_MISSING)
    tls = worker_tls(settings)
    wanted = scheme(tls)
    for spec in settings.workers:
        given, _, _ = parse_worker_spec(spec)
        if given not in (wanted, "dns"):
            how = "with worker TLS" if tls is not None else "without worker TLS"
            raise WorkerSpecError(f"{spec!r}: workers are reached by {wanted}:// {how}")
    return WorkerLink.create(
        settings.worker_secret.get_secret_value(),
        settings.worker_signing_key.get_secret_value(),
        tls,
    )
