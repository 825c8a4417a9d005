"""API key format, generation and verification.

A key reads `pgk_<key id>_<secret><checksum>`: the key id is public and indexes the row, the
secret has 256 bits of entropy, and a 6-character CRC32 checksum lets typos and secret
scanners tell a real key from noise without a database lookup. Only an HMAC-SHA256 of the
secret under the server's key-hashing secret is stored; comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import zlib
from dataclasses import dataclass

PREFIX = "pgk"
_ALPHABET = string.digits + string.ascii_letters  # base62
_KEY_ID_CHARS = string.ascii_lowercase + string.digits
KEY_ID_LENGTH = 12
SECRET_LENGTH = 43  # 43 base62 characters carry > 256 bits
CHECKSUM_LENGTH = 6


class MalformedKey(ValueError):
    """The presented string is not a PrefixGate key (wrong shape or checksum)."""


@dataclass(frozen=True, slots=True)
class ParsedKey:
    key_id: str
    secret: str


def _base62(number: int, width: int) -> str:
    digits = []
    for _ in range(width):
        number, remainder = divmod(number, 62)
        digits.append(_ALPHABET[remainder])
    return "".join(reversed(digits))


def _checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), CHECKSUM_LENGTH)


def format_key(parts: ParsedKey) -> str:
    """The full key string for an id and a secret, checksum included."""
    body = f"{PREFIX}_{parts.key_id}_{parts.secret}"
    return body + _checksum(body)


def new_key() -> tuple[str, ParsedKey]:
    """A fresh key: the full string to show once, and its parts."""
    key_id = "".join(secrets.choice(_KEY_ID_CHARS) for _ in range(KEY_ID_LENGTH))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LENGTH))
    parts = ParsedKey(key_id, secret)
    return format_key(parts), parts


def parse_key(presented: str) -> ParsedKey:
    """Split a presented key into id and secret, checking shape and checksum."""
    fields = presented.split("_")
    if len(fields) != 3 or fields[0] != PREFIX:
        raise MalformedKey("not a PrefixGate API key")
    key_id, tail = fields[1], fields[2]
    if len(key_id) != KEY_ID_LENGTH or len(tail) != SECRET_LENGTH + CHECKSUM_LENGTH:
        raise MalformedKey("not a PrefixGate API key")
    parsed = ParsedKey(key_id, tail[:SECRET_LENGTH])
    if not hmac.compare_digest(presented.encode(), format_key(parsed).encode()):
        raise MalformedKey("API key checksum mismatch (a typo?)")
    return parsed


def hash_secret(secret: str, server_secret: str) -> str:
    """HMAC-SHA256 of a key's secret under the server secret, hex."""
    return hmac.new(server_secret.encode(), secret.encode(), hashlib.sha256).hexdigest()


def secret_matches(secret: str, stored_hash: str, server_secret: str) -> bool:
    return hmac.compare_digest(hash_secret(secret, server_secret), stored_hash)
