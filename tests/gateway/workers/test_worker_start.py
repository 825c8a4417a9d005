"""Neither a worker nor a routing gateway starts without what protects the traffic between
them: certificates (or plain HTTP chosen explicitly), and the request signing key. Each refusal
is one line naming what to set, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.local_workers import SIGNING_KEY, session_certificates
from tests.support.cli import Cli

SECRET = "worker-start-secret-0123"


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    runner = Cli("sqlite:///unused.db", tmp_path)
    runner.env.update(PREFIXGATE_WORKER_SECRET=SECRET, PREFIXGATE_WORKER_SIGNING_KEY=SIGNING_KEY)
    return runner


def test_a_worker_without_certificates_refuses_to_serve_plain_http(cli: Cli) -> None:
    line = cli.error("worker", "--port", "1")
    assert "PREFIXGATE_WORKER_TLS_CERT" in line and "PREFIXGATE_WORKER_PLAINTEXT=true" in line


def test_a_worker_without_the_signing_key_refuses_to_start(cli: Cli) -> None:
    del cli.env["PREFIXGATE_WORKER_SIGNING_KEY"]
    cli.env.update(PREFIXGATE_WORKER_PLAINTEXT="true")
    assert "PREFIXGATE_WORKER_SIGNING_KEY" in cli.error("worker", "--port", "1")


def test_half_the_tls_settings_are_refused(cli: Cli) -> None:
    cli.env.update(PREFIXGATE_WORKER_TLS_CERT=str(session_certificates().ca))
    line = cli.error("worker", "--port", "1")
    assert "PREFIXGATE_WORKER_TLS_CA" in line and "PREFIXGATE_WORKER_TLS_KEY" in line


def test_a_routing_gateway_without_certificates_refuses_to_start(cli: Cli) -> None:
    cli.env.update(PREFIXGATE_WORKERS="https://127.0.0.1:1")
    assert "PREFIXGATE_WORKER_TLS_CERT" in cli.error("serve", "--port", "1")


def test_a_gateway_with_certificates_refuses_a_plain_http_worker_address(cli: Cli) -> None:
    tls = {k: str(v) for k, v in session_certificates().gateway_environment().items()}
    cli.env.update({f"PREFIXGATE_{name}": value for name, value in tls.items()})
    cli.env.update(PREFIXGATE_WORKERS="http://127.0.0.1:1")
    assert "workers are reached by https://" in cli.error("serve", "--port", "1")
