"""Block keys: canonical, chained, scoped, and stable across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from engine.cache.block_hash import BlockHasher, HashObject, encode_scope, encode_token_ids
from engine.cache.budget import PoolExhausted
from engine.cache.cache_request import KeyChain
from engine.cache.scope import NO_CACHE, Public, Segment, Tenant, User, block_scopes
from tests.support.cache import make_manager, request, run_prompt

ALICE = User("t1", "alice")


def keys(tokens: list[int], scope=ALICE, block_size: int = 4, root_model: str = "m") -> list[bytes]:
    hasher = BlockHasher(block_size)
    root = hasher.root(root_model, "", "float32")
    scopes = [scope] * (len(tokens) // block_size)
    return hasher.chain(root, encode_token_ids(tokens), scopes)


def test_only_full_blocks_get_keys() -> None:
    assert len(keys(list(range(11)))) == 2
    assert len(keys(list(range(12)))) == 3


def test_key_depends_on_every_earlier_token() -> None:
    base = keys(list(range(12)))
    changed = keys([99, *range(1, 12)])
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_key_depends_on_scope_and_root() -> None:
    tokens = list(range(8))
    variants = [
        keys(tokens),
        keys(tokens, scope=User("t1", "bob")),
        keys(tokens, scope=Tenant("t1")),
        keys(tokens, scope=Public("ns")),
        keys(tokens, root_model="other-model"),
        keys(tokens, block_size=2)[1::2],
    ]
    flat = [key for variant in variants for key in variant]
    assert len(set(flat)) == len(flat)


def test_root_covers_model_adapter_dtype_and_block_size() -> None:
    hasher = BlockHasher(16)
    roots = {
        hasher.root("m", "", "bfloat16"),
        hasher.root("m2", "", "bfloat16"),
        hasher.root("m", "lora-a", "bfloat16"),
        hasher.root("m", "", "float16"),
        BlockHasher(32).root("m", "", "bfloat16"),
    }
    assert len(roots) == 5


def test_scope_encoding_is_unambiguous() -> None:
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    assert encode_scope(User("ab", "c")) != encode_scope(User("a", "bc"))
    assert encode_scope(Tenant("x")) != encode_scope(Public("x"))
    with pytest.raises(ValueError):
        encode_scope(NO_CACHE)


def test_token_ids_are_fixed_width_little_endian() -> None:
    assert encode_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(ValueError):
        encode_token_ids([-1])
    with pytest.raises(ValueError):
        encode_token_ids([2**32])


def test_keys_are_stable_across_processes_and_hash_seeds() -> None:
    program = (
        "from engine.cache.block_hash import BlockHasher, encode_token_ids\n"
        "from engine.cache.scope import User\n"
        "h = BlockHasher(4)\n"
        "print(h.chain(h.root('m', '', 'float32'), encode_token_ids(range(8)), "
        "[User('t1', 'alice')] * 2)[-1].hex())\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", program],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {keys(list(range(8)))[-1].hex()}


def test_blocks_from_the_first_no_cache_block_on_get_no_keys() -> None:
    hasher = BlockHasher(4)
    root = hasher.root("m", "", "float32")
    scopes = [Public("ns"), ALICE, NO_CACHE, ALICE]
    assert len(hasher.chain(root, encode_token_ids(range(16)), scopes)) == 2


def test_block_takes_most_private_scope_and_chain_stays_private() -> None:
    segments = [Segment(0, 6, Public("ns")), Segment(6, 9, ALICE), Segment(9, 14, Public("ns"))]
    scopes = block_scopes(segments, 16, 4, tail_scope=ALICE)
    # Block 1 mixes public and private tokens; blocks after the first private one stay private.
    assert scopes == [Public("ns"), ALICE, ALICE, ALICE]


def test_uncovered_tokens_take_the_tail_scope() -> None:
    scopes = block_scopes([Segment(0, 8, Public("ns"))], 12, 4, tail_scope=ALICE)
    assert scopes == [Public("ns"), Public("ns"), ALICE]


def test_conflicting_private_scopes_are_rejected() -> None:
    segments = [Segment(0, 3, ALICE), Segment(3, 8, User("t1", "bob"))]
    with pytest.raises(ValueError, match="conflicting"):
        block_scopes(segments, 8, 4, tail_scope=ALICE)


def test_segments_must_tile_the_prompt() -> None:
    with pytest.raises(ValueError, match="tile"):
        block_scopes([Segment(0, 3, ALICE), Segment(4, 8, ALICE)], 8, 4, tail_scope=ALICE)


def test_a_request_kept_waiting_keys_its_prompt_once_across_admission_attempts() -> None:
    hashed: list[bytes] = []

    def counting_hash(data: bytes) -> HashObject:
        hashed.append(data)
        return hashlib.blake2b(data)

    manager = make_manager(num_blocks=8, new_hash=counting_hash)
    run_prompt(manager, request("t1", range(100, 120), Tenant("t1")), free=False)  # 5 blocks
    waiter = request("t2", list(range(30)), Tenant("t2"))  # 8 blocks: the pool has 3 left
    chain = KeyChain.of(waiter, manager.block_size)
    before = len(hashed)
    for _ in range(3):
        hit = manager.match(waiter, chain)
        assert isinstance(manager.admit(hit, 30 - hit.cached_tokens), PoolExhausted)
    # Every full block before the last token, keyed at the first attempt only.
    assert len(hashed) - before == len(chain.keys) == (30 - 1) // manager.block_size
