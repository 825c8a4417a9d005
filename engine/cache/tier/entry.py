"""A block as the tier holds it: its identity, its entry id, and the plaintext that is sealed.

The plaintext of a block is its identity followed by its KV bytes. The identity is a tag and
the length-prefixed parent key, scope (`encode_scope`) and token ids: self-delimiting, so two
different identities never encode to bytes of which one starts the other. A loaded value
counts only when its identity is exactly the one the caller expects (collision safety, I3):
the tag of the sealed value already ties it to its block key and root, and the identity ties
the key to the tokens, scope and parent it was computed from, as the pool's prefix cache does.

Stores never see block keys: an entry's id is a digest of (root, block key), so a key a
worker publishes for routing names no entry, and two models' entries never share an id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.cache.block_hash import TOKEN_ID_BYTES, BlockHash, encode_scope, length_prefixed
from engine.cache.budget import Owner
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope

ENTRY_ID_BYTES = 16
_ENTRY_ID_PERSON = b"pg-tier-entry"
_IDENTITY_TAG = b"prefixgate/tier-block/v1"
# Room in a sealed value besides KV and token ids: the identity's tag, lengths and parent key,
# a scope of up to 1 KiB, and the seal's header (a key id of up to 800 bytes), nonce and tag.
_SEALED_SLACK = 2048


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A block offloaded to (or wanted from) the tier: its key and what the key was made of,
    and who pays for it there."""

    key: BlockHash
    parent_key: BlockHash
    scope: CacheScope
    token_bytes: bytes
    owner: Owner


def entry_id(root: BlockHash, key: BlockHash) -> bytes:
    """The store's id of block `key` of chain `root` (a digest, never the key itself)."""
    return hashlib.blake2b(
        length_prefixed(root) + length_prefixed(key),
        digest_size=ENTRY_ID_BYTES,
        person=_ENTRY_ID_PERSON,
    ).digest()


def sealed_size_bound(spec: KVSpec) -> int:
    """The largest sealed value of a block of `spec` whose scope encodes to at most 1 KiB."""
    return spec.bytes_per_block + TOKEN_ID_BYTES * spec.block_size + _SEALED_SLACK


def encode_identity(block: TierBlock) -> bytes:
    """The unambiguous bytes of a block's parent key, scope and token ids."""
    return (
        _IDENTITY_TAG
        + length_prefixed(block.parent_key)
        + length_prefixed(encode_scope(block.scope))
        + length_prefixed(block.token_bytes)
    )


def block_plaintext(block: TierBlock, kv_bytes: bytes) -> bytes:
    """What is sealed for a block: its identity, then its KV."""
    return encode_identity(block) + kv_bytes


def kv_of(block: TierBlock, plaintext: bytes) -> memoryview | None:
    """The KV bytes of a plaintext written for `block`, or None when its identity is another."""
    identity = encode_identity(block)
    if not plaintext.startswith(identity):
        return None
    return memoryview(plaintext)[len(identity) :]
