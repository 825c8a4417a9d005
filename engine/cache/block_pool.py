"""The block pool: who owns KV memory, ref counts, the LRU of idle cached blocks, zeroing.

Memory layout: one preallocated tensor for the whole cache,
`kv[layer, 0 for K / 1 for V, block, slot, kv_head, head_dim]`. One tensor means that zeroing
any set of blocks is a single `index_fill_` over the block dimension, and `kv[layer, 0]` is a
contiguous `[num_blocks * block_size, kv_heads, head_dim]` slot array for the attention code.

A block is in exactly one of four states:
- free: zeroed, in `_free`, owned by nobody;
- dirty: left a scope (evicted, purged, freed without caching) and waits for the next batched
  zeroing; never handed out before it;
- active: `ref_count > 0`, owned by the owner its scope names;
- idle: cached (has a key), `ref_count == 0`, in its owner's LRU queue, evictable.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine import huge_pages
from engine.cache.block_hash import BlockHash
from engine.cache.budget import Owner
from engine.cache.kv_spec import KVSpec
from engine.cache.scope import CacheScope


@dataclass(slots=True, eq=False)
class Block:
    """One block of `block_size` KV slots and, once cached, what it holds."""

    block_id: int
    ref_count: int = 0
    owner: Owner | None = None
    # Bumped every time the block goes back to the pool, so a stale reference to an earlier
    # life of this block (a child's parent link) can never match the new one.
    generation: int = 0
    # Set while cached: the verified identity of the block's contents.
    key: BlockHash | None = None
    parent_key: BlockHash | None = None
    parent_id: int = -1
    parent_generation: int = -1
    scope: CacheScope | None = None
    token_bytes: bytes = b""
    last_released: int = 0


ZeroBlocks = Callable[[torch.Tensor, torch.Tensor], None]


def fill_zero(kv: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Zero blocks `block_ids` of the pool in every layer, K and V: one `index_fill_`."""
    kv.index_fill_(2, block_ids, 0)


class BlockPool:
    """A fixed number of KV blocks, handed out zeroed and taken back by ref count.

    `zero_blocks` wipes a list of blocks (`fill_zero` unless the attention backend brings a
    kernel for it).
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        device: str | torch.device = "cpu",
        zero_blocks: ZeroBlocks = fill_zero,
        kv: torch.Tensor | None = None,
    ) -> None:
        """`kv`: memory to use (zeroed here) instead of allocating the pool's own."""
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.spec = spec
        self.zero_blocks = zero_blocks
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if kv is None and torch.device(device).type == "cpu":
            kv = huge_pages.zeros(shape, spec.dtype)  # read from memory at every step
        elif kv is None:
            kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        elif tuple(kv.shape) != shape or kv.dtype != spec.dtype:
            raise ValueError("kv does not have the pool's shape and dtype")
        else:
            kv.zero_()
        self.kv = kv
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._dirty: list[int] = []
        self._idle: dict[Owner, OrderedDict[int, None]] = {}
        self._owned: Counter[Owner] = Counter()
        self._num_idle = 0
        self._clock = 0
        self.blocks_zeroed = 0
        self.zero_operations = 0

    def fresh(self) -> BlockPool:
        """A pool over this one's memory, all of it zeroed and free, for an engine whose
        bookkeeping can no longer be trusted; zeroing counters carry on."""
        pool = BlockPool(self.spec, self.num_blocks, self.kv.device, self.zero_blocks, self.kv)
        pool.blocks_zeroed = self.blocks_zeroed + self.num_blocks
        pool.zero_operations = self.zero_operations + 1
        return pool

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out without evicting anything."""
        return len(self._free) + len(self._dirty)

    @property
    def num_active(self) -> int:
        """Blocks with at least one user."""
        return self.num_blocks - self.num_available - self._num_idle

    def owned(self, owner: Owner) -> int:
        """Blocks an owner holds, active and idle cached."""
        return self._owned[owner]

    def idle_count(self, owner: Owner) -> int:
        queue = self._idle.get(owner)
        return len(queue) if queue else 0

    def owners(self) -> list[Owner]:
        return [owner for owner, count in self._owned.items() if count]

    def idle_owners(self) -> Iterator[Owner]:
        return (owner for owner, queue in self._idle.items() if queue)

    def oldest_idle(self, owner: Owner) -> Block | None:
        """The owner's least recently used idle cached block (a chain's tail before its head)."""
        queue = self._idle.get(owner)
        if not queue:
            return None
        return self.blocks[next(iter(queue))]

    def idle_blocks(self, owner: Owner) -> list[Block]:
        """The owner's idle cached blocks, least recently used first."""
        return [self.blocks[block_id] for block_id in self._idle.get(owner, ())]

    # -- transitions --------------------------------------------------------------------------

    def take(self, owner: Owner, count: int) -> list[Block]:
        """Hand out `count` zeroed blocks to `owner` with one reference each."""
        if count > self.num_available:
            raise RuntimeError(f"take({count}) with only {self.num_available} available")
        if count > len(self._free):
            self.flush_zeroing()
        taken = []
        for _ in range(count):
            block = self.blocks[self._free.popleft()]
            block.ref_count = 1
            block.owner = owner
            taken.append(block)
        self._owned[owner] += count
        return taken

    def ref(self, block: Block) -> None:
        """Add a user to a cached block; an idle block leaves its LRU queue."""
        if block.ref_count == 0:
            assert block.owner is not None and block.key is not None
            del self._idle[block.owner][block.block_id]
            self._num_idle -= 1
        block.ref_count += 1

    def unref(self, block: Block) -> None:
        """Drop a user; at zero a cached block turns idle, an uncached one goes to be zeroed."""
        assert block.ref_count > 0, f"unref of unused block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.key is None:
            self._release(block)
            return
        assert block.owner is not None
        self._clock += 1
        block.last_released = self._clock
        self._idle.setdefault(block.owner, OrderedDict())[block.block_id] = None
        self._num_idle += 1

    def evict(self, block: Block) -> None:
        """Take an idle cached block back; the caller removes its key from the prefix cache."""
        assert block.ref_count == 0 and block.owner is not None
        del self._idle[block.owner][block.block_id]
        self._num_idle -= 1
        self._release(block)

    def copy_block(self, source: Block, target: Block) -> None:
        """Copy `source`'s K and V, in every layer, into `target` (a block just taken)."""
        assert target.ref_count == 1 and target.key is None, "copy into a shared block"
        self.kv[:, :, target.block_id].copy_(self.kv[:, :, source.block_id])

    def clear_identity(self, block: Block) -> None:
        """Strip the cache identity of an active block: it is zeroed when its last user leaves."""
        block.key = None
        block.parent_key = None
        block.scope = None
        block.token_bytes = b""

    def _release(self, block: Block) -> None:
        assert block.owner is not None
        self._owned[block.owner] -= 1
        self.clear_identity(block)
        block.owner = None
        block.parent_id = -1
        block.parent_generation = -1
        block.generation += 1
        self._dirty.append(block.block_id)

    def flush_zeroing(self) -> int:
        """Zero every dirty block in one batched tensor operation; returns how many."""
        if not self._dirty:
            return 0
        index = torch.tensor(self._dirty, dtype=torch.long, device=self.kv.device)
        self.zero_blocks(self.kv, index)
        count = len(self._dirty)
        self._free.extend(self._dirty)
        self._dirty.clear()
        self.blocks_zeroed += count
        self.zero_operations += 1
        return count

    # -- checks -------------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Assert the pool's bookkeeping invariants (used by tests and debug runs)."""
        free, dirty = set(self._free), set(self._dirty)
        assert len(free) == len(self._free) and not free & dirty, "block both free and dirty"
        idle: set[int] = set()
        owned: Counter[Owner] = Counter()
        for owner, queue in self._idle.items():
            for block_id in queue:
                block = self.blocks[block_id]
                assert block.owner == owner and block.ref_count == 0 and block.key is not None
                idle.add(block_id)
            stamps = [self.blocks[block_id].last_released for block_id in queue]
            assert stamps == sorted(stamps), "LRU queue out of order"
        for block in self.blocks:
            in_pool = block.block_id in free or block.block_id in dirty
            if in_pool:
                assert block.ref_count == 0 and block.owner is None and block.key is None
            else:
                assert block.owner is not None, f"block {block.block_id} lost"
                assert (block.ref_count == 0) == (block.block_id in idle), "idle/active mix-up"
                owned[block.owner] += 1
        assert +owned == +self._owned, "owner counts drifted"
        assert len(idle) == self._num_idle, "idle count drifted"
