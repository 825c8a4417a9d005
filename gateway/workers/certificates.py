"""A private certificate authority for the traffic between gateways and engine workers.

`prefixgate certs init` makes the CA (`ca.pem`, and `ca.key` which only this command reads);
`prefixgate certs issue NAME` makes `NAME.pem` and `NAME.key` signed by it. Keys are ECDSA
P-256 (every OpenSSL that Python and uvicorn link handles them), written 0600, and never
overwritten unless asked (`force`).

A certificate's extended key usage says what it may be: a *server* (a worker: TLS server auth)
or a *client* (a gateway: TLS client auth), or both. OpenSSL checks it on each side, so a
worker's certificate cannot call another worker and a gateway's cannot pose as a worker.

Gateways dial workers by address (a `dns://` name resolves to pod IPs nobody knows in
advance), so they verify a worker's certificate against the CA *and* a fixed name,
`WORKER_SERVER_NAME` (gateway/workers/tls.py), not against the address they dialled. Every
server certificate carries that name among its DNS names; `--san` adds more (for other tools
that dial a worker by its own name or address).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The DNS name every worker's certificate carries and every gateway verifies.
WORKER_SERVER_NAME = "prefixgate-worker"
CA_CERT, CA_KEY = "ca.pem", "ca.key"
CA_DAYS = 3650  # the CA outlives the certificates it signs; rotate it with a new `init`
CERT_DAYS = 397  # what public CAs may issue at most: a yearly rotation
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid a little before now: clocks differ


class CertificateError(ValueError):
    """A certificate that cannot be made as asked (one line, for the CLI)."""


@dataclass(frozen=True, slots=True)
class Issued:
    """Where a certificate and its key were written."""

    cert: Path
    key: Path


def init_ca(directory: Path, force: bool = False, name: str = "PrefixGate worker CA") -> Issued:
    """A new private CA in `directory` (created 0700 if missing): `ca.pem` and `ca.key` (0600)."""
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    _refuse_overwrite([cert_path, key_path], force)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(key_path, _key_pem(key))
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return Issued(cert_path, key_path)


def issue(
    directory: Path,
    name: str,
    sans: list[str],
    server: bool,
    client: bool,
    force: bool = False,
    days: int = CERT_DAYS,
) -> Issued:
    """`NAME.pem` and `NAME.key` (0600) in `directory`, signed by its CA, for a server (a
    worker: it also carries `WORKER_SERVER_NAME`), a client (a gateway) or both."""
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise CertificateError(f"{name!r}: a certificate name is letters, digits, - _ and .")
    if name == CA_CERT.removesuffix(".pem"):
        raise CertificateError("'ca' is the CA's own name; choose another")
    if not (server or client):
        raise CertificateError("a certificate is for a server, a client or both")
    if not 1 <= days <= 3650:
        raise CertificateError(f"validity must be 1 to 3650 days, not {days}")
    names = [_san(text) for text in sans]
    ca_cert, ca_key = _load_ca(directory)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    _refuse_overwrite([cert_path, key_path], force)
    if server and x509.DNSName(WORKER_SERVER_NAME) not in names:
        names.insert(0, x509.DNSName(WORKER_SERVER_NAME))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    certificate = builder.sign(ca_key, hashes.SHA256())
    _write(key_path, _key_pem(key))
    _write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return Issued(cert_path, key_path)


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    """A CA's key signs certificates (and revocation lists); a leaf's signs TLS handshakes."""
    return x509.KeyUsage(
        digital_signature=not signs_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def _san(text: str) -> x509.GeneralName:
    """`DNS:name`, `IP:address`, or a bare name or address."""
    prefix, _, rest = text.partition(":")
    kind, value = (prefix.upper(), rest) if prefix.upper() in ("DNS", "IP") else ("", text)
    if kind == "IP" or (not kind and _is_address(value)):
        try:
            return x509.IPAddress(ipaddress.ip_address(value))
        except ValueError:
            raise CertificateError(f"{text!r}: not an IP address") from None
    labels = value.rstrip(".").split(".")
    wildcard_ok = labels[0] == "*" and len(labels) > 2
    if (
        not value
        or len(value) > 253
        or not all(_is_label(label) for label in (labels[1:] if wildcard_ok else labels))
    ):
        raise CertificateError(f"{text!r}: not a DNS name (use DNS:name or IP:address)")
    return x509.DNSName(value.rstrip(".").lower())


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_label(label: str) -> bool:
    return (
        0 < len(label) <= 63
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        and not label.startswith("-")
        and not label.endswith("-")
    )


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        certificate = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    except FileNotFoundError:
        raise CertificateError(
            f"no CA in {directory} (make one with `prefixgate certs init --dir {directory}`)"
        ) from None
    except (OSError, ValueError, TypeError) as error:
        raise CertificateError(f"cannot read the CA in {directory}: {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"the CA key in {directory} is not an ECDSA key")
    return certificate, key


def _refuse_overwrite(paths: list[Path], force: bool) -> None:
    existing = [str(path) for path in paths if path.exists()]
    if existing and not force:
        raise CertificateError(f"{', '.join(existing)} already there (--force replaces it)")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` with `mode` from the first byte (a key is never readable by others)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as output:
        output.write(data)
    os.chmod(path, mode)  # the umask may have taken bits away from a certificate's mode
