"""A block as the tier holds it: its identity, its entry id, and the plaintext that is sealed.

The plaintext of a block is its identity followed by its KV bytes. The identity is a tag and
the length-prefixed parent key, scope (`encode_scope`) and token ids: self-delimiting, so two
different identities never encode to bytes of which one starts the other. A loaded value
counts only when its identity is exactly the one the caller expects (collision safety, I3):
the tag of the sealed value already ties it to its block key and root, and the identity ties
the key to the tokens, scope and parent it was computed from, as the pool's prefix cache does.

Stores never see block keys, and an entry's id says nothing to whoever reads the store: it is
keyed BLAKE2b of (version, root, block key) under an id key derived from the data key the
block is sealed with (its tenant's, or its public prefix's; `entry_id_key`). Block keys are
computable from public information (the root, the token ids, the scope), so an unkeyed digest
would let anyone who reads the store check a guessed prompt offline; a keyed one cannot be
computed without the owner's data key. Two models' entries never share an id (the root is
hashed), nor two owners' (their keys differ). A tenant's entries are deleted through the
store's owner index, never by recomputing ids.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.block_hash import TOKEN_ID_BYTES, BlockHash, encode_scope, length_prefixed
from engine.cache.budget import Owner
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope
from engine.cache.tier.sealing import SealKey

ENTRY_ID_BYTES = 16
# 2: ids keyed by the owner's data key (1 was an unkeyed digest of root and block key).
ENTRY_ID_VERSION = 2
_ENTRY_ID_PERSON = b"pg-tier-entry-v2"
# The id key is HMAC-SHA256(data key, this label): the AES key itself never keys a MAC.
_ID_KEY_LABEL = b"prefixgate/tier/entry-id-key/v2"
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


def entry_id_key(seal_key: SealKey) -> bytes:
    """The key an owner's entry ids are made with, derived from its data key."""
    return hmac.digest(seal_key.secret, _ID_KEY_LABEL, "sha256")


def entry_id(seal_key: SealKey, root: BlockHash, key: BlockHash) -> bytes:
    """The store's id of block `key` of chain `root`, sealed with `seal_key`: a digest keyed
    by its owner's id key, never the block key itself."""
    return _keyed_id(entry_id_key(seal_key), root, key)


def entry_ids(
    root: BlockHash, keys: Sequence[BlockHash], seal_keys: Sequence[SealKey]
) -> list[bytes]:
    """`entry_id` of each block of `keys` with the data key beside it (each distinct data
    key's id key derived once)."""
    id_keys: dict[SealKey, bytes] = {}
    ids = []
    for key, seal_key in zip(keys, seal_keys, strict=True):
        id_key = id_keys.get(seal_key)
        if id_key is None:
            id_key = id_keys[seal_key] = entry_id_key(seal_key)
        ids.append(_keyed_id(id_key, root, key))
    return ids


def _keyed_id(id_key: bytes, root: BlockHash, key: BlockHash) -> bytes:
    return hashlib.blake2b(
        bytes([ENTRY_ID_VERSION]) + length_prefixed(root) + length_prefixed(key),
        digest_size=ENTRY_ID_BYTES,
        key=id_key,
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
