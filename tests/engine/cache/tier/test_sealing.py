"""Sealed values open only for their own block, root and key; every other read is a miss
with its reason, never an exception and never data."""

from __future__ import annotations

import os

import pytest

from engine.cache.tier.sealing import SealKey, open_sealed, seal, seal_overhead, unseal

ROOT = os.urandom(32)
BLOCK = os.urandom(32)
KEY = SealKey("tenant-a/1", os.urandom(32))
PLAINTEXT = os.urandom(1000)


def test_sealed_value_opens_under_its_key_block_and_root() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert unseal(KEY, ROOT, BLOCK, sealed) == PLAINTEXT
    assert len(sealed) == len(PLAINTEXT) + seal_overhead(KEY.key_id)
    assert PLAINTEXT not in sealed


def test_each_seal_takes_a_fresh_nonce() -> None:
    assert seal(KEY, ROOT, BLOCK, PLAINTEXT) != seal(KEY, ROOT, BLOCK, PLAINTEXT)


def test_value_moved_to_another_block_key_fails_its_tag() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(KEY, ROOT, os.urandom(32), sealed) == "tag"


def test_value_read_under_another_root_fails_its_tag() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(KEY, os.urandom(32), BLOCK, sealed) == "tag"


def test_value_read_under_another_key_id_is_a_key_miss() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(SealKey("tenant-a/2", os.urandom(32)), ROOT, BLOCK, sealed) == "key"


def test_value_read_under_another_secret_with_the_same_id_fails_its_tag() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(SealKey(KEY.key_id, os.urandom(32)), ROOT, BLOCK, sealed) == "tag"


def test_relabelled_key_id_fails_its_tag() -> None:
    """Rewriting the key id in the header (same length) to the reader's id cannot help."""
    other = SealKey("tenant-b/1", os.urandom(32))
    sealed = bytearray(seal(KEY, ROOT, BLOCK, PLAINTEXT))
    sealed[3 : 3 + len(KEY.key_id)] = other.key_id.encode()
    assert open_sealed(other, ROOT, BLOCK, bytes(sealed)) == "tag"


@pytest.mark.parametrize("position", [0, 3, 20, 500, -1])
def test_one_flipped_bit_anywhere_is_a_miss(position: int) -> None:
    sealed = bytearray(seal(KEY, ROOT, BLOCK, PLAINTEXT))
    sealed[position] ^= 0x01
    assert open_sealed(KEY, ROOT, BLOCK, bytes(sealed)) in {"malformed", "key", "tag"}
    assert unseal(KEY, ROOT, BLOCK, bytes(sealed)) is None


def test_flipped_bit_in_the_ciphertext_fails_its_tag() -> None:
    sealed = bytearray(seal(KEY, ROOT, BLOCK, PLAINTEXT))
    sealed[100] ^= 0x80
    assert open_sealed(KEY, ROOT, BLOCK, bytes(sealed)) == "tag"


@pytest.mark.parametrize("length", [0, 1, 2, 5, 20, 40])
def test_truncated_value_is_malformed(length: int) -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(KEY, ROOT, BLOCK, sealed[:length]) == "malformed"


def test_value_truncated_inside_its_ciphertext_fails_its_tag() -> None:
    sealed = seal(KEY, ROOT, BLOCK, PLAINTEXT)
    assert open_sealed(KEY, ROOT, BLOCK, sealed[:-1]) == "tag"


def test_another_version_is_malformed() -> None:
    sealed = bytearray(seal(KEY, ROOT, BLOCK, PLAINTEXT))
    sealed[0] = 2
    assert open_sealed(KEY, ROOT, BLOCK, bytes(sealed)) == "malformed"
