"""Entry ids are keyed by the owner's data key: whoever reads the store (every Redis key, field,
member and value; every byte of the disk file) cannot check a guessed prompt's blocks there,
since the ids it could compute from public information (root, tokens, scope) appear nowhere.
One block under two owners' keys is two entries; a discard deletes the ids the tier made."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from engine.cache.block_hash import BlockHash, length_prefixed
from engine.cache.budget import PUBLIC_OWNER
from engine.cache.scope import Public, User
from engine.cache.tier import disk_store
from engine.cache.tier.entry import ENTRY_ID_BYTES, TierBlock, entry_id, entry_ids
from engine.cache.tier.kv_tier import KVTier
from engine.cache.tier.sealing import SealKey
from tests.engine.cache.tier.conftest import (
    HASHER,
    ROOT,
    SPEC,
    Backend,
    blocks_of,
    open_tier,
    random_kv,
    seal_key,
)

TENANT_KEY = seal_key("tenant-t1/1")
PREFIX_KEY = seal_key("prefix-p1/1")


def plain_ids(root: BlockHash, key: BlockHash) -> list[bytes]:
    """The ids anyone can compute from a block key: the unkeyed digest ids used to be, and
    today's digest without its key."""
    data = length_prefixed(root) + length_prefixed(key)
    return [
        hashlib.blake2b(data, digest_size=ENTRY_ID_BYTES, person=b"pg-tier-entry").digest(),
        hashlib.blake2b(
            bytes([2]) + data, digest_size=ENTRY_ID_BYTES, person=b"pg-tier-entry-v2"
        ).digest(),
    ]


def guessable(blocks: Sequence[TierBlock]) -> list[bytes]:
    """What an attacker with a guessed prompt derives per block: its key and plain ids, raw
    and in hex."""
    found = []
    for block in blocks:
        for value in (block.key, *plain_ids(ROOT, block.key)):
            found += [bytes(value), value.hex().encode()]
    return found


def redis_dump(url: str, prefix: str) -> bytes:
    """Every key name under `prefix` and everything each holds, as one blob."""
    client: Any = redis.Redis.from_url(url)  # bytes in, bytes out
    parts: list[bytes] = []
    for name in client.scan_iter(match=f"{prefix}:*"):
        parts.append(name)
        kind = client.type(name)
        if kind == b"string":
            parts.append(client.get(name) or b"")
        elif kind == b"hash":
            for field, value in client.hgetall(name).items():
                parts += [field, value]
        elif kind == b"zset":
            parts += [member for member, _ in client.zrange(name, 0, -1, withscores=True)]
        elif kind == b"set":
            parts += list(client.smembers(name))
    client.close()
    return b"\n".join(parts)


def store_bytes(backend: Backend) -> bytes:
    if backend.kind == "disk":
        return backend.path.read_bytes()
    return redis_dump(backend.url, backend.prefix)


def offload(tier: KVTier, blocks: Sequence[TierBlock], key: SealKey) -> None:
    for i, block in enumerate(blocks):
        assert tier.offload(block, key, random_kv(i), 1.0)
    tier.flush()


def test_a_blocks_id_depends_on_its_owners_data_key() -> None:
    block_key = HASHER.chain(ROOT, bytes(4 * SPEC.block_size), [Public("ns")])[0]
    other_root = HASHER.root("another-model", "", "bfloat16")
    ids = {
        entry_id(TENANT_KEY, ROOT, block_key),
        entry_id(PREFIX_KEY, ROOT, block_key),
        entry_id(TENANT_KEY, other_root, block_key),
        *plain_ids(ROOT, block_key),
    }
    assert len(ids) == 5
    assert entry_id(TENANT_KEY, ROOT, block_key) == entry_id(TENANT_KEY, ROOT, block_key)
    # The same secret under another key id makes the same ids: the secret keys them.
    same_secret = SealKey("renamed", TENANT_KEY.secret)
    assert (
        entry_ids(ROOT, [block_key] * 2, [TENANT_KEY, same_secret])
        == [entry_id(TENANT_KEY, ROOT, block_key)] * 2
    )


def test_the_store_holds_no_id_computable_from_a_guessed_prompt(backend: Backend) -> None:
    """A private prompt's blocks and a public prefix's, offloaded: every id in the store is
    keyed, and neither the block keys nor any plain id of them is anywhere in it."""
    tier = open_tier(backend)
    private = blocks_of(list(range(200, 216)), User("t1", "alice"), "t1")
    public = blocks_of(list(range(16)), Public("ns"), PUBLIC_OWNER)  # type: ignore[arg-type]
    offload(tier, private, TENANT_KEY)
    offload(tier, public, PREFIX_KEY)
    tier.flush()
    dump = store_bytes(backend)
    keyed = entry_ids(ROOT, [b.key for b in private], [TENANT_KEY] * 4) + entry_ids(
        ROOT, [b.key for b in public], [PREFIX_KEY] * 4
    )
    # The dump is where ids live: each keyed id is there (raw on disk, hex in Redis)...
    written = [i if backend.kind == "disk" else i.hex().encode() for i in keyed]
    assert all(block_id in dump for block_id in written)
    # ...and nothing an attacker derives from the guessed tokens and scopes is.
    leaked = [value for value in guessable(private + public) if value in dump]
    assert leaked == []
    tier.close()


def test_one_block_under_two_owners_keys_is_two_entries_each_read_with_its_key(
    backend: Backend,
) -> None:
    """A public block matched under two registered prefixes (two data keys)."""
    tier = open_tier(backend)
    block = blocks_of(list(range(4)), Public("ns"), PUBLIC_OWNER)[0]  # type: ignore[arg-type]
    other = seal_key("prefix-p2/1")
    assert tier.offload(block, PREFIX_KEY, random_kv(1), 1.0)
    assert tier.offload(block, other, random_kv(2), 1.0)
    tier.flush()
    assert tier.stats().owners[PUBLIC_OWNER].entries == 2
    assert tier.contains([block.key] * 3, [PREFIX_KEY, other, seal_key()]) == [True, True, False]
    first, second = (tier.load([block], [key])[0] for key in (PREFIX_KEY, other))
    assert first is not None and second is not None
    assert first.equal(random_kv(1)) and second.equal(random_kv(2))
    tier.discard([block.key])  # both: the tier made both ids
    tier.flush()
    assert tier.contains([block.key] * 2, [PREFIX_KEY, other]) == [False, False]
    tier.close()


def test_a_discard_deletes_only_the_ids_the_tier_still_remembers(backend: Backend) -> None:
    """Ids cannot be computed without the owner's key, which a discard does not carry: the
    tier remembers the most recent blocks' ids, up to a bound."""
    tier = KVTier(backend.open(), SPEC, ROOT, remembered_blocks=2)
    blocks = blocks_of(list(range(300, 316)), User("t1", "u"), "t1")
    offload(tier, blocks, TENANT_KEY)
    tier.discard([b.key for b in blocks])
    tier.flush()
    keys = [TENANT_KEY] * 4
    assert tier.contains([b.key for b in blocks], keys) == [True, True, False, False]
    # Probing names the first two again (with the key): now a discard finds them.
    assert tier.contains([b.key for b in blocks[:2]], keys[:2]) == [True, True]
    tier.discard([b.key for b in blocks])
    tier.flush()
    assert tier.contains([b.key for b in blocks], keys) == [False] * 4
    tier.close()


def test_a_disk_file_of_unkeyed_ids_starts_over(tmp_path: Path) -> None:
    """A version 1 file (its ids name guessable blocks) is not kept across the upgrade."""
    backend = Backend("disk", tmp_path)
    tier = open_tier(backend)
    offload(tier, blocks_of(list(range(4)), User("t1", "u"), "t1"), TENANT_KEY)
    tier.close()
    with backend.path.open("r+b") as file:  # the same file, as version 1 wrote its header
        body = disk_store._FILE_HEADER.unpack(file.read(disk_store._FILE_HEADER.size))
        old = disk_store._FILE_HEADER.pack(b"PGTIER\x00\x01", *body[1:])
        file.seek(0)
        file.write(old + disk_store._checksum(old))
    reopened = backend.open()
    assert reopened.usage() == {}
    assert os.path.getsize(backend.path) >= disk_store.FILE_HEADER_BYTES
    reopened.close()
