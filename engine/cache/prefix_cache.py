"""The prefix cache: block key -> cached block, with every hit verified.

A key is a hash, and hashes can collide (or be made to, with a weak hash in a test). So a hit
counts only when the stored block holds exactly the same token ids under the same scope, was
committed after the same parent key, and its parent is the very block (same id, same
generation) matched just before it. Anything else is a miss.
"""

from __future__ import annotations

from engine.cache.block_hash import BlockHash
from engine.cache.block_pool import Block, extends
from engine.cache.scope import CacheScope


class PrefixCache:
    """Maps block keys to the blocks that hold them."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, Block] = {}
        self.collisions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._blocks

    def keys(self) -> list[BlockHash]:
        """Every key held now (a copy)."""
        return list(self._blocks)

    def lookup(
        self,
        key: BlockHash,
        parent_key: BlockHash,
        parent: Block | None,
        scope: CacheScope,
        token_bytes: bytes,
    ) -> Block | None:
        """The cached block for `key` if it verifiably holds these tokens after this parent."""
        block = self._blocks.get(key)
        if block is None:
            return None
        if _same_contents(block, parent_key, parent, scope, token_bytes):
            return block
        self.collisions += 1
        return None

    def insert(
        self,
        block: Block,
        key: BlockHash,
        parent_key: BlockHash,
        parent: Block | None,
        scope: CacheScope,
        token_bytes: bytes,
    ) -> Block | None:
        """Cache `block` under `key`; returns the block now cached for these contents.

        If an identical block is already cached (two requests computed the same prefix at
        once), that one is returned and `block` stays uncached. If a different block holds
        the key (a collision), nothing is cached and None is returned.
        """
        existing = self._blocks.get(key)
        if existing is not None:
            if _same_contents(existing, parent_key, parent, scope, token_bytes):
                return existing
            self.collisions += 1
            return None
        block.key = key
        block.parent_key = parent_key
        block.parent_id = -1 if parent is None else parent.block_id
        block.parent_generation = -1 if parent is None else parent.generation
        block.scope = scope
        block.token_bytes = token_bytes
        # What eviction by value needs: how deep the block is (its recompute cost grows with
        # it) and that the parent is no longer a leaf.
        block.position = 0 if parent is None else parent.position + 1
        if parent is not None and extends(block, parent):
            parent.children += 1
        self._blocks[key] = block
        return block

    def remove(self, block: Block) -> None:
        """Drop a block's key, if the block is the one cached under it."""
        if block.key is not None and self._blocks.get(block.key) is block:
            del self._blocks[block.key]


def _same_contents(
    block: Block,
    parent_key: BlockHash,
    parent: Block | None,
    scope: CacheScope,
    token_bytes: bytes,
) -> bool:
    if parent is None:
        same_parent = block.parent_id == -1
    else:
        same_parent = (
            block.parent_id == parent.block_id and block.parent_generation == parent.generation
        )
    return (
        same_parent
        and block.parent_key == parent_key
        and block.scope == scope
        and block.token_bytes == token_bytes
    )
