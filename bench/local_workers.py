"""Engine workers as processes on this machine (`prefixgate worker`), for tests and benchmarks.

They serve over mutual TLS, as in production: certificates from the same code as `prefixgate
certs` (a CA, a worker certificate for 127.0.0.1, a gateway client certificate), made once per
process (`session_certificates`); `LocalCertificates.gateway_settings()` gives a gateway what
it needs to reach them, `ServerProcess.request` lets a test call a worker as a gateway would.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.local_server import free_port, wait_until_ready
from gateway.workers.certificates import init_ca, issue
from gateway.workers.link import WorkerLink
from gateway.workers.signing import SIGNATURE_HEADER, RequestSigner, action_view
from gateway.workers.tls import WorkerTLS

# The gateways' request signing key of every local cluster (a test value, never a real one).
SIGNING_KEY = "local-workers-request-signing-key-0123456789"


@dataclass(frozen=True)
class LocalCertificates:
    """A private CA with one worker certificate (for 127.0.0.1) and one gateway certificate."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def worker_environment(self) -> dict[str, str]:
        return {
            "PREFIXGATE_WORKER_TLS_CERT": str(self.directory / "worker.pem"),
            "PREFIXGATE_WORKER_TLS_KEY": str(self.directory / "worker.key"),
            "PREFIXGATE_WORKER_TLS_CA": str(self.ca),
        }

    def gateway_settings(self) -> dict[str, Any]:
        """A gateway's settings to reach the workers (and sign its requests)."""
        return {
            "worker_tls_cert": self.directory / "gateway.pem",
            "worker_tls_key": self.directory / "gateway.key",
            "worker_tls_ca": self.ca,
            "worker_signing_key": SIGNING_KEY,
        }

    def gateway_environment(self) -> dict[str, str]:
        """`gateway_settings` as the environment of a gateway process (without the prefix)."""
        return {key.upper(): str(value) for key, value in self.gateway_settings().items()}


def make_certificates(directory: Path) -> LocalCertificates:
    """A CA, a worker's server certificate and a gateway's client certificate in `directory`."""
    init_ca(directory)
    issue(directory, "worker", ["IP:127.0.0.1"], server=True, client=False)
    issue(directory, "gateway", [], server=False, client=True)
    return LocalCertificates(directory)


_SESSION_LOCK = threading.Lock()


def session_certificates() -> LocalCertificates:
    """This process's certificates, made the first time they are asked for. Locked: workers
    started side by side (threads) must all get the one CA, not one each."""
    with _SESSION_LOCK:
        return _session_certificates()


@functools.cache
def _session_certificates() -> LocalCertificates:
    directory = Path(tempfile.mkdtemp(prefix="prefixgate-certs-"))
    atexit.register(shutil.rmtree, directory, True)
    return make_certificates(directory / "certs")


@dataclass
class ServerProcess:
    """A `prefixgate` server (a worker, a gateway) in a process of its own: its URL and log."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    certificates: LocalCertificates | None = None  # a worker's, when it serves over TLS

    def request(
        self,
        method: str,
        path: str,
        certificates: LocalCertificates | None = None,
        signed: tuple[str, str] | None = None,
        **options: Any,
    ) -> httpx.Response:
        """Call the server as a gateway would: with the gateway's client certificate (of
        `certificates`, else those it serves with). `signed=(secret, action)` adds the secret
        and a gateway's signature of the JSON body, as a gateway's admin action carries."""
        certs = certificates or self.certificates
        verify: Any = True if certs is None else gateway_context(certs)
        if signed is not None:
            secret, action = signed
            body = options.get("json")
            options["headers"] = {
                **options.get("headers", {}),
                "Authorization": f"Bearer {secret}",
                SIGNATURE_HEADER: RequestSigner(SIGNING_KEY).sign(action_view(action, body)),
            }
        options.setdefault("timeout", 30)
        with httpx.Client(verify=verify) as client:
            return client.request(method, f"{self.url}{path}", **options)

    def kill(self) -> None:
        """Die at once, as a crashed machine would (no drain, no goodbye)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


LocalWorker = ServerProcess  # an engine worker


def gateway_tls(certificates: LocalCertificates) -> WorkerTLS:
    """A gateway's side of these certificates."""
    directory = certificates.directory
    return WorkerTLS(directory / "gateway.pem", directory / "gateway.key", certificates.ca)


def gateway_context(certificates: LocalCertificates) -> ssl.SSLContext:
    """The TLS context a gateway with these certificates dials workers with."""
    return gateway_tls(certificates).client_context()


def gateway_link(secret: str, certificates: LocalCertificates | None = None) -> WorkerLink:
    """A gateway's link to local workers (over `certificates`, else the session's)."""
    return WorkerLink.create(
        secret, SIGNING_KEY, gateway_tls(certificates or session_certificates())
    )


@contextmanager
def worker_process(
    model_dir: Path | None,
    secret: str,
    log_dir: Path,
    environment: dict[str, str] | None = None,
    start_timeout_s: float = 180.0,
    plaintext: bool = False,
) -> Iterator[LocalWorker]:
    """A `prefixgate worker` on a free localhost port, ready when yielded, stopped after; over
    mutual TLS with `session_certificates()` unless `plaintext`."""
    port = free_port()
    certificates = None if plaintext else session_certificates()
    env = {
        **os.environ,
        **(environment or {}),
        "PREFIXGATE_WORKER_SECRET": secret,
        "PREFIXGATE_WORKER_SIGNING_KEY": SIGNING_KEY,
        **({"PREFIXGATE_WORKER_PLAINTEXT": "true"} if certificates is None else {}),
        **(certificates.worker_environment() if certificates is not None else {}),
    }
    command = [_prefixgate(), "worker", "--host", "127.0.0.1", "--port", str(port)]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    log = log_dir / f"worker-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    scheme = "http" if certificates is None else "https"
    worker = LocalWorker(process, f"{scheme}://127.0.0.1:{port}", log, certificates)
    try:
        verify = True if certificates is None else gateway_context(certificates)
        wait_until_ready(worker.url, process, log, start_timeout_s, verify)
        yield worker
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """Ask a server process to stop (SIGTERM: it finishes what it serves), then make it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextmanager
def worker_processes(
    count: int, model_dir: Path | None, secret: str, log_dir: Path, **options: object
) -> Iterator[list[LocalWorker]]:
    """`count` workers, started one after another (each loads the model)."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(worker_process(model_dir, secret, log_dir, **options))  # type: ignore[arg-type]
            for _ in range(count)
        ]


def _prefixgate() -> str:
    """The `prefixgate` script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("prefixgate")
    return str(beside) if beside.exists() else shutil.which("prefixgate") or "prefixgate"
