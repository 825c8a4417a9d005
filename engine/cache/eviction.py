"""Which idle cached block leaves first: the one worth the least per byte.

Quotas decide who loses blocks and how many (`Quotas.plan`); the eviction policy decides which.
Under "value" a block's worth is the prefill time its reuse saves: the hits it has served
(`BlockPool.ref` of a cached block), plus one, times what recomputing it would cost at its
position in its chain (`BlockCost`: the engine measures it, a later block attends over more
positions and costs more), per byte it occupies. On that value sits GreedyDual's aging: a
block's priority is the value on top of a clock, fixed when the block turns idle, and the clock
rises to the priority of each block evicted by value, so a block that stops being reused is
overtaken by newer ones and leaves in the end, however often it was hit before.

Two rules come before priority: a block that other cached blocks of its owner extend goes only
when its owner has no idle leaf (a chain is cut from its tail: its head is what every reuse
needs), and equal priorities go least recently used first. Under pressure from another owner
the victim is the lowest-ranked candidate among the owners the plan allows. "lru" evicts the
least recently used idle block, as the pool did before value, for comparison.

The pool keeps the order (`BlockPool.victim`, `BlockPool.rank`); the tier prices its entries
with the same two functions below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

# "value": the least expected prefill time saved per byte goes first; "lru": the least
# recently used, kept for comparison.
EvictionPolicy = Literal["value", "lru"]

# What recomputing the block at a prompt's block index costs, in milliseconds.
BlockCost = Callable[[int], float]


def position_cost(index: int) -> float:
    """A cost model for engines without a measured one: a block's attention reads every
    position before it, so a later block costs more (1 ms, plus 1 ms per block before it)."""
    return 1.0 + index


def value_per_byte(hits: int, saved_ms: float, num_bytes: int) -> float:
    """A cached block's expected value: the prefill time its reuse has saved so far, per byte
    it occupies (a block never hit is worth one reuse, so new blocks get a chance)."""
    return (hits + 1) * saved_ms / num_bytes


def aged_priority(clock: float, value: float) -> float:
    """A block's eviction priority (lowest goes first): its value on top of the priority of
    the last block evicted, so blocks that stop being reused age out (GreedyDual)."""
    return clock + value
