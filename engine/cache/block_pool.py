"""The block pool: who owns KV memory, ref counts, the order idle cached blocks leave in, zeroing.

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

Which idle block of an owner goes first is the pool's eviction policy (engine/cache/eviction.py):
under "lru" the head of the owner's LRU queue, O(1); under "value" the top of the owner's
min-heap of (has cached children, priority, release time), the priority fixed when the block
turned idle. The heap is lazy: a block leaving the idle state only loses its stamp, and its
stale entry is dropped when it reaches the top (or, once stale entries outnumber live ones, by
a rebuild), so every operation stays O(log idle blocks) however large the pool. A block's
children are the cached blocks of the same owner that extend it (`extends`): a block without
any is a leaf, and leaves go first, so chains are cut from their tails. A block extended only
by another owner's blocks (a public prompt under tenants' chats) is its owner's leaf: counted
as a parent, it would leave only once its owner had no leaf at all, and then head first.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine import huge_pages
from engine.cache.block_hash import BlockHash
from engine.cache.budget import Owner
from engine.cache.eviction import (
    BlockCost,
    EvictionPolicy,
    aged_priority,
    position_cost,
    value_per_byte,
)
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
    # Eviction by value, while cached: the block's index in its chain, the hits it served,
    # its children (see `extends`), and its priority as of when it last turned idle.
    position: int = 0
    hits: int = 0
    children: int = 0
    priority: float = 0.0
    # The stamp of the block's live entry in its owner's heap (0: none, the block is not idle
    # or the policy is "lru").
    heap_stamp: int = 0


def extends(child: Block, parent: Block) -> bool:
    """Whether `parent` counts cached `child` among its children: the child was cached after
    this life of the parent, which is still cached and has the child's owner."""
    return (
        child.key is not None
        and parent.key is not None
        and child.parent_id == parent.block_id
        and child.parent_generation == parent.generation
        and child.owner == parent.owner
    )


# Where a block stands in the eviction order, lowest first: (has cached children, priority,
# release time); under "lru" only the release time differs.
Rank = tuple[bool, float, int]
# An entry of an owner's heap: the block's rank as filed, then its stamp and id.
HeapEntry = tuple[bool, float, int, int, int]


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
        self.eviction: EvictionPolicy = "lru"
        self.block_cost: BlockCost = position_cost
        self._block_bytes = spec.bytes_per_block
        # GreedyDual's clock: the highest priority of any block evicted by value so far.
        self.value_clock = 0.0
        self._heaps: dict[Owner, list[HeapEntry]] = {}
        self._stamps = 0
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

    def victim(self, owner: Owner) -> Block | None:
        """The owner's idle cached block to evict next under the pool's policy: "lru", the
        least recently used; "value", its lowest-priority leaf, or lowest-priority block of all
        when none of its idle blocks is a leaf."""
        if self.eviction == "lru":
            return self.oldest_idle(owner)
        heap = self._heaps.get(owner)
        while heap:
            entry = heap[0]
            block = self.blocks[entry[-1]]
            if block.heap_stamp != entry[-2]:  # it left the idle state (or was refiled) since
                heapq.heappop(heap)
            elif entry[:3] != self.rank(block):  # it gained a child while idle
                heapq.heappop(heap)
                self._file(block)
            else:
                return block
        return None

    def rank(self, block: Block) -> Rank:
        """Where an idle block stands in the eviction order, also among other owners' blocks
        (lowest goes first): a leaf before a block with children, then by priority, then the
        least recently used; under "lru" by release time alone."""
        if self.eviction == "lru":
            return (False, 0.0, block.last_released)
        return (block.children > 0, block.priority, block.last_released)

    def oldest_idle(self, owner: Owner) -> Block | None:
        """The owner's least recently used idle cached block (a chain's tail before its head)."""
        queue = self._idle.get(owner)
        if not queue:
            return None
        return self.blocks[next(iter(queue))]

    def idle_blocks(self, owner: Owner) -> list[Block]:
        """The owner's idle cached blocks, least recently used first."""
        return [self.blocks[block_id] for block_id in self._idle.get(owner, ())]

    # -- eviction policy ----------------------------------------------------------------------

    def set_eviction(self, policy: EvictionPolicy, block_cost: BlockCost = position_cost) -> None:
        """Evict by `policy` from now on; `block_cost` prices a block by its position (ms).

        Idle blocks are ordered at once: under "value" each is priced as if it turned idle now.
        """
        self.eviction, self.block_cost = policy, block_cost
        self._heaps.clear()
        idle = [self.blocks[block_id] for queue in self._idle.values() for block_id in queue]
        for block in idle:
            block.heap_stamp = 0
        if policy == "value":
            for block in idle:
                self._price(block)
                self._file(block)

    def _price(self, block: Block) -> None:
        """Fix an idle block's priority: the prefill time its reuse saves per byte, on top of
        the clock."""
        saved_ms = self.block_cost(block.position)
        value = value_per_byte(block.hits, saved_ms, self._block_bytes)
        block.priority = aged_priority(self.value_clock, value)

    def _file(self, block: Block) -> None:
        """Push an idle block's entry onto its owner's heap; the entry before it goes stale."""
        assert block.owner is not None
        self._stamps += 1
        block.heap_stamp = self._stamps
        heap = self._heaps.setdefault(block.owner, [])
        heapq.heappush(heap, (*self.rank(block), block.heap_stamp, block.block_id))
        if len(heap) > 2 * len(self._idle[block.owner]) + 32:  # mostly stale: start afresh
            idle = (self.blocks[block_id] for block_id in self._idle[block.owner])
            heap[:] = [(*self.rank(b), b.heap_stamp, b.block_id) for b in idle]
            heapq.heapify(heap)

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
        """Add a user to a cached block (a hit); an idle block leaves its LRU queue."""
        if block.ref_count == 0:
            assert block.owner is not None and block.key is not None
            self._leave_idle(block)
        # A fork's reference to a parent's cached blocks counts too: another choice reads them.
        if block.key is not None:
            block.hits += 1
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
        if self.eviction == "value":
            self._price(block)
            self._file(block)

    def evict(self, block: Block, by_policy: bool = False) -> None:
        """Take an idle cached block back; the caller removes its key from the prefix cache.

        `by_policy`: the block is a `victim` (not an admin's purge), so under "value" the
        clock rises to its priority (GreedyDual's aging; never down, since an owner's own
        victim can rank above another owner's idle blocks).
        """
        assert block.ref_count == 0 and block.owner is not None
        if by_policy and self.eviction == "value":
            self.value_clock = max(self.value_clock, block.priority)
        self._leave_idle(block)
        self._release(block)

    def _leave_idle(self, block: Block) -> None:
        assert block.owner is not None
        del self._idle[block.owner][block.block_id]
        self._num_idle -= 1
        block.heap_stamp = 0

    def copy_block(self, source: Block, target: Block) -> None:
        """Copy `source`'s K and V, in every layer, into `target` (a block just taken)."""
        assert target.ref_count == 1 and target.key is None, "copy into a shared block"
        self.kv[:, :, target.block_id].copy_(self.kv[:, :, source.block_id])

    def clear_identity(self, block: Block) -> None:
        """Strip the cache identity of an active block: it is zeroed when its last user leaves.

        Its parent loses a child (and may become a leaf); its own children no longer count
        (`extends` needs a cached parent), so its count starts again at zero.
        """
        if block.key is not None and block.parent_id >= 0:
            parent = self.blocks[block.parent_id]
            if extends(block, parent):
                parent.children -= 1
                if not parent.children and parent.heap_stamp:  # an idle leaf now
                    self._file(parent)
        block.children = 0
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
        block.position = block.hits = 0
        block.priority = 0.0
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
            self._check_heap(owner, queue)
        self._check_children()
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

    def _check_heap(self, owner: Owner, idle: OrderedDict[int, None]) -> None:
        """Under "value", the owner's heap holds exactly one live entry per idle block, with
        its priority, filed as having children only if it has (one filed as a leaf may have
        gained a child while idle: it is refiled when it reaches the top)."""
        if self.eviction == "lru":
            assert owner not in self._heaps, "a heap under lru"
            assert all(not self.blocks[block_id].heap_stamp for block_id in idle)
            return
        live = {}
        for has_children, priority, released, stamp, block_id in self._heaps.get(owner, []):
            block = self.blocks[block_id]
            if block.heap_stamp == stamp:
                assert block_id not in live, "two live heap entries for one block"
                assert (priority, released) == (block.priority, block.last_released), "stale"
                assert block.children > 0 or not has_children, "a leaf filed with children"
                live[block_id] = block
        assert set(live) == set(idle), "heap and idle blocks disagree"

    def _check_children(self) -> None:
        """Every block's children count is the number of cached blocks that extend it."""
        children: Counter[int] = Counter()
        for block in self.blocks:
            if block.parent_id >= 0 and extends(block, self.blocks[block.parent_id]):
                children[block.parent_id] += 1
        for block in self.blocks:
            assert block.children == children[block.block_id], "children count drifted"
            if block.heap_stamp:
                assert block.ref_count == 0 and block.key is not None, "a busy block filed"
