"""Sealing tier values: AES-256-GCM under the owner's data key.

A sealed value is `version (1 byte) | key id length (2 bytes, little-endian) | key id (UTF-8)
| nonce (12 bytes) | ciphertext and 16-byte tag`. The nonce is fresh and random for every
seal (96 bits: with at most billions of seals per key, a repeat is out of reach). The
associated data binds the value to where it may be read: a version tag, the chain's root
(model, adapter, KV dtype, block size), the block key and the key id, each length-prefixed.
So a value copied to another entry, read under another model or another key fails its tag:
a miss, never data. Opening never raises; `open_sealed` says why a value did not open, so
the tier can count misses by reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from engine.cache.block_hash import length_prefixed

VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
_AD_TAG = b"prefixgate/tier/v1"
_KEY_ID_LENGTH_BYTES = 2

# Why a sealed value did not open: not a value this module writes (or another version), sealed
# under another key id than the one offered, or its tag failed (tampered, moved, wrong key).
SealMiss = Literal["malformed", "key", "tag"]


@dataclass(frozen=True, slots=True)
class SealKey:
    """A data key: `key_id` names it (not secret), `secret` is 32 random bytes (AES-256)."""

    key_id: str
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != 32:
            raise ValueError("a seal key is 32 bytes")
        if not self.key_id or len(self.key_id) > 200:
            raise ValueError("a seal key's id is 1 to 200 characters")


def seal_overhead(key_id: str) -> int:
    """How many bytes sealing adds to a plaintext under a key with this id."""
    return 1 + _KEY_ID_LENGTH_BYTES + len(key_id.encode("utf-8")) + NONCE_BYTES + TAG_BYTES


def _associated_data(root: bytes, block_key: bytes, key_id: bytes) -> bytes:
    return (
        _AD_TAG
        + bytes([VERSION])
        + length_prefixed(root)
        + length_prefixed(block_key)
        + length_prefixed(key_id)
    )


def seal(key: SealKey, root: bytes, block_key: bytes, plaintext: bytes) -> bytes:
    """Encrypt and authenticate `plaintext` for block `block_key` of chain `root`."""
    key_id = key.key_id.encode("utf-8")
    nonce = os.urandom(NONCE_BYTES)
    # A new AESGCM per call: caching one would keep a deleted tenant's secret alive in memory.
    sealed = AESGCM(key.secret).encrypt(nonce, plaintext, _associated_data(root, block_key, key_id))
    header = bytes([VERSION]) + len(key_id).to_bytes(_KEY_ID_LENGTH_BYTES, "little") + key_id
    return header + nonce + sealed


def open_sealed(key: SealKey, root: bytes, block_key: bytes, value: bytes) -> bytes | SealMiss:
    """The plaintext sealed in `value` for this block, or why it is a miss."""
    view = memoryview(value)
    if len(view) < 1 + _KEY_ID_LENGTH_BYTES or view[0] != VERSION:
        return "malformed"
    key_id_end = 1 + _KEY_ID_LENGTH_BYTES + int.from_bytes(view[1:3], "little")
    if len(view) < key_id_end + NONCE_BYTES + TAG_BYTES:
        return "malformed"
    key_id = bytes(view[1 + _KEY_ID_LENGTH_BYTES : key_id_end])
    if key_id != key.key_id.encode("utf-8"):
        return "key"
    nonce = bytes(view[key_id_end : key_id_end + NONCE_BYTES])
    try:
        return AESGCM(key.secret).decrypt(
            nonce, view[key_id_end + NONCE_BYTES :], _associated_data(root, block_key, key_id)
        )
    except InvalidTag:
        return "tag"


def unseal(key: SealKey, root: bytes, block_key: bytes, value: bytes) -> bytes | None:
    """The plaintext sealed in `value` for this block, or None (`open_sealed` says why)."""
    opened = open_sealed(key, root, block_key, value)
    return opened if isinstance(opened, bytes) else None
