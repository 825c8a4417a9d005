"""Block keys: a cryptographic hash chain over (parent key, scope, token ids).

`root = H(model_fingerprint, adapter_id, kv_dtype, block_size)` and
`key_i = H(key_{i-1}, scope_i, token_ids_i)`. H is BLAKE2b truncated to 256 bits (the
unkeyed 512-bit variant is the cheapest call from Python) over a canonical byte encoding:
a tag, the scope (a tag byte and length-prefixed fields), the 32-byte parent key, the token
ids as fixed-width little-endian uint32. Each part is self-delimiting, so the encoding is
unambiguous. Never pickle, never Python's `hash()`: keys must be stable across processes and
hard to collide.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import abc
from functools import cache
from typing import NewType, Protocol

from engine.cache.scope import CacheScope, NoCache, Public, Tenant, User

BlockHash = NewType("BlockHash", bytes)


class HashObject(Protocol):
    def digest(self) -> bytes: ...


# A hashlib-style constructor: data in, an object with `.digest()` out. Passing hashlib's own
# constructor keeps the per-block cost at one C call, with no Python frame in between.
HashConstructor = abc.Callable[[bytes], HashObject]
DEFAULT_HASH: HashConstructor = hashlib.blake2b
KEY_BYTES = 32

# Every token id is packed into this many bytes; a block's tokens are `block_size` times that.
TOKEN_ID_BYTES = 4

_ROOT_TAG = b"prefixgate/root/v1"
_BLOCK_TAG = b"B"


def encode_token_ids(token_ids: abc.Sequence[int]) -> bytes:
    """Token ids as fixed-width little-endian uint32 bytes (`TOKEN_ID_BYTES` each)."""
    try:
        packed = array("I", token_ids)
    except OverflowError as error:
        raise ValueError("token ids must fit in an unsigned 32-bit integer") from error
    if packed.itemsize != TOKEN_ID_BYTES:  # pragma: no cover - no mainstream platform has this
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def block_token_bytes(token_bytes: bytes | bytearray, index: int, block_size: int) -> bytes:
    """The encoded token ids of block `index` in a sequence encoded by `encode_token_ids`."""
    stride = TOKEN_ID_BYTES * block_size
    return bytes(token_bytes[index * stride : (index + 1) * stride])


def length_prefixed(data: bytes) -> bytes:
    """`data` behind its 4-byte little-endian length, so consecutive fields can never run
    together (every encoding of keys and sealed tier values is built of such fields)."""
    return len(data).to_bytes(4, "little") + data


def _length_prefixed(text: str) -> bytes:
    """UTF-8 text, length-prefixed."""
    return length_prefixed(text.encode("utf-8"))


@cache
def encode_scope(scope: CacheScope) -> bytes:
    """Canonical, unambiguous bytes for a scope: a tag byte, then length-prefixed fields."""
    match scope:
        case Public(namespace):
            return b"P" + _length_prefixed(namespace)
        case Tenant(tenant_id):
            return b"T" + _length_prefixed(tenant_id)
        case User(tenant_id, user_id):
            return b"U" + _length_prefixed(tenant_id) + _length_prefixed(user_id)
        case NoCache():
            raise ValueError("NoCache blocks have no key")
    raise TypeError(f"not a cache scope: {scope!r}")


class BlockHasher:
    """Computes root and chained block keys; the hash function is injectable for tests."""

    def __init__(self, block_size: int, new_hash: HashConstructor = DEFAULT_HASH) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._new_hash = new_hash

    def root(self, model_fingerprint: str, adapter_id: str, kv_dtype: str) -> BlockHash:
        """The chain's root: everything besides tokens and scope that changes the KV values."""
        data = (
            _ROOT_TAG
            + _length_prefixed(model_fingerprint)
            + _length_prefixed(adapter_id)
            + _length_prefixed(kv_dtype)
            + self.block_size.to_bytes(4, "little")
        )
        return BlockHash(self._new_hash(data).digest()[:KEY_BYTES])

    def chain(
        self,
        parent: BlockHash,
        token_bytes: bytes | bytearray,
        scopes: abc.Sequence[CacheScope],
        first_block: int = 0,
        end_block: int | None = None,
    ) -> list[BlockHash]:
        """Keys of blocks `first_block` up to `end_block` (default: all full blocks).

        `token_bytes` is the whole sequence encoded by `encode_token_ids`; `parent` is the key
        of block `first_block - 1` (or the root). Stops at the first block without a full
        set of tokens and at the first `NoCache` block (it and everything after it has no key).
        """
        stride = TOKEN_ID_BYTES * self.block_size
        full_blocks = min(len(token_bytes) // stride, len(scopes))
        if end_block is not None:
            full_blocks = min(full_blocks, end_block)
        keys: list[BlockHash] = []
        append = keys.append
        new_hash = self._new_hash
        last_scope: CacheScope | None = None
        prefix = b""
        # The hot loop of every request: one hash call per block, the scope's bytes encoded
        # once per run of blocks with the same scope.
        for index in range(first_block, full_blocks):
            scope = scopes[index]
            if scope is not last_scope:
                if isinstance(scope, NoCache):
                    break
                prefix = _BLOCK_TAG + encode_scope(scope)
                last_scope = scope
            offset = index * stride
            data = prefix + parent + token_bytes[offset : offset + stride]
            parent = new_hash(data).digest()[:KEY_BYTES]  # type: ignore[assignment]
            append(parent)
        return keys
