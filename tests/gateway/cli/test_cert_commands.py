"""`prefixgate certs init|issue`, through the real console script: a private CA and the
certificates gateways and workers present to each other; keys 0600, nothing overwritten
unless asked, bad input refused in one line."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from gateway.workers.certificates import WORKER_SERVER_NAME
from tests.support.cli import Cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli("sqlite:///unused.db", tmp_path)  # the certs commands touch no database


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_makes_a_ca_whose_key_only_its_owner_reads(cli: Cli, tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    cli.ok("certs", "init", "--dir", str(directory))
    ca = load(directory / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert mode(directory / "ca.key") == 0o600
    assert mode(directory) == 0o700


def test_issue_makes_a_worker_and_a_gateway_certificate_the_ca_signed(
    cli: Cli, tmp_path: Path
) -> None:
    directory = tmp_path / "certs"
    cli.ok("certs", "init", "--dir", str(directory))
    cli.ok("certs", "issue", "worker", "--dir", str(directory), "--server",
           "--san", "IP:10.0.0.7", "--san", "DNS:worker.example")  # fmt: skip
    cli.ok("certs", "issue", "gateway", "--dir", str(directory), "--client")
    worker, gateway, ca = (load(directory / f"{n}.pem") for n in ("worker", "gateway", "ca"))
    for certificate in (worker, gateway):
        certificate.verify_directly_issued_by(ca)
        assert mode(directory / f"{certificate.subject.rfc4514_string()[3:]}.key") == 0o600
    names = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert WORKER_SERVER_NAME in names.get_values_for_type(x509.DNSName)  # what gateways check
    assert "worker.example" in names.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("10.0.0.7") in names.get_values_for_type(x509.IPAddress)
    usages = {
        c: c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        for c in (worker, gateway)
    }
    assert list(usages[worker]) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert list(usages[gateway]) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # The files load as Python's ssl (and so uvicorn and httpx) loads them.
    ssl.create_default_context(cafile=directory / "ca.pem").load_cert_chain(
        directory / "gateway.pem", directory / "gateway.key"
    )


def test_nothing_is_overwritten_without_force(cli: Cli, tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    cli.ok("certs", "init", "--dir", str(directory))
    first_ca = (directory / "ca.pem").read_bytes()
    assert "already there (--force replaces it)" in cli.error(
        "certs", "init", "--dir", str(directory)
    )
    cli.ok("certs", "issue", "gateway", "--dir", str(directory), "--client")
    first = (directory / "gateway.key").read_bytes()
    line = cli.error("certs", "issue", "gateway", "--dir", str(directory), "--client")
    assert "gateway.pem" in line and "--force" in line
    assert (directory / "gateway.key").read_bytes() == first
    assert (directory / "ca.pem").read_bytes() == first_ca
    cli.ok("certs", "issue", "gateway", "--dir", str(directory), "--client", "--force")
    assert (directory / "gateway.key").read_bytes() != first
    assert mode(directory / "gateway.key") == 0o600


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--server", "--san", "IP:300.1.1.1"], "not an IP address"),
        (["--server", "--san", "DNS:bad_name!"], "not a DNS name"),
        (["--server", "--san", "DNS:"], "not a DNS name"),
        ([], "--server (a worker), --client (a gateway), or both"),
        (["--role", "both", "--client"], "not both"),
        (["--server", "--days", "0"], "validity must be 1 to 3650 days"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    cli: Cli, tmp_path: Path, arguments: list[str], says: str
) -> None:
    directory = tmp_path / "certs"
    cli.ok("certs", "init", "--dir", str(directory))
    assert says in cli.error("certs", "issue", "w", "--dir", str(directory), *arguments)
    assert not (directory / "w.pem").exists() and not (directory / "w.key").exists()


def test_issuing_without_a_ca_says_how_to_make_one(cli: Cli, tmp_path: Path) -> None:
    line = cli.error("certs", "issue", "w", "--dir", str(tmp_path / "none"), "--server")
    assert "prefixgate certs init" in line


def test_a_name_that_is_a_path_is_refused(cli: Cli, tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    cli.ok("certs", "init", "--dir", str(directory))
    assert "a certificate name is" in cli.error(
        "certs", "issue", "../escape", "--dir", str(directory), "--client"
    )
    assert not (tmp_path / "escape.key").exists()
