"""The two scripts deploy/ ships: the container health check (run against a real HTTP server and
a real listening socket on loopback) and the secret-file generator."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY


class _Health(BaseHTTPRequestHandler):
    """/healthz answers 200, /readyz 503: alive, not ready."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass


@pytest.fixture
def server_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def healthcheck(port: int, *args: str) -> int:
    environ = {**os.environ, "PREFIXGATE_PORT": str(port)}
    environ.pop("PREFIXGATE_HEALTHCHECK_URL", None)
    command = [sys.executable, str(DEPLOY / "healthcheck.py"), *args]
    return subprocess.run(command, env=environ, capture_output=True, timeout=30).returncode


def test_healthcheck_passes_on_200_and_fails_on_503(server_port: int) -> None:
    assert healthcheck(server_port) == 0
    assert healthcheck(server_port, "/readyz") == 1


def free_port() -> int:
    with socket.socket() as probe:  # a loopback port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_healthcheck_fails_when_nothing_listens() -> None:
    assert healthcheck(free_port()) == 1


def test_tcp_healthcheck_passes_when_the_port_accepts_connections() -> None:
    """A worker's check (`--tcp`): it asks nothing over the connection, since only a gateway's
    certificate gets through the worker's TLS handshake."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert healthcheck(listener.getsockname()[1], "--tcp") == 0
    assert healthcheck(free_port(), "--tcp") == 1


def generate(example: Path, output: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(DEPLOY / "generate_secrets.py"), str(example), str(output)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def test_generator_fills_placeholders_with_distinct_private_values(tmp_path: Path) -> None:
    example = tmp_path / "x.env.example"
    example.write_text(
        "# a comment = kept\nA=CHANGE_ME\nB=CHANGE_ME\n"
        "URL=postgresql://u:CHANGE_ME@db/x\nPLAIN=kept\n"
    )
    output = tmp_path / "x.env"
    result = generate(example, output)
    assert result.returncode == 0, result.stderr
    lines = output.read_text().splitlines()
    values = dict(line.split("=", 1) for line in lines[1:])
    assert lines[0] == "# a comment = kept"
    assert values["A"] != values["B"] and len(values["A"]) >= 32
    assert "CHANGE_ME" not in values["A"] + values["B"]
    assert values["URL"] == "postgresql://u:CHANGE_ME@db/x" and values["PLAIN"] == "kept"
    assert "edit URL" in result.stderr
    assert stat.S_IMODE(output.stat().st_mode) == 0o600


def test_generator_fills_references_to_names_set_above(tmp_path: Path) -> None:
    example = tmp_path / "x.env.example"
    example.write_text(
        "PASSWORD=CHANGE_ME\nURL=redis://:${PASSWORD}@redis:6379/0\n"
        "LATER=${NOT_YET}\nNOT_YET=CHANGE_ME\nEDIT=${EXTERNAL}:CHANGE_ME\n"
    )
    output = tmp_path / "x.env"
    result = generate(example, output)
    assert result.returncode == 0, result.stderr
    values = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert values["URL"] == f"redis://:{values['PASSWORD']}@redis:6379/0"
    assert values["LATER"] == "${NOT_YET}", "only names set above are filled in"
    assert values["EDIT"] == "${EXTERNAL}:CHANGE_ME" and "edit EDIT" in result.stderr
    assert "edit URL" not in result.stderr


def test_generator_never_overwrites_secrets(tmp_path: Path) -> None:
    example = tmp_path / "x.env.example"
    example.write_text("A=CHANGE_ME\n")
    output = tmp_path / "x.env"
    output.write_text("A=the-deployment's-own\n")
    assert generate(example, output).returncode == 1
    assert output.read_text() == "A=the-deployment's-own\n"
