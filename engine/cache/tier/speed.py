"""How fast blocks come back from the tier, and whether loading them beats recomputing them.

A load of n bytes takes a fixed latency plus n over a bandwidth (fetch, unseal, checks and
priority updates included), fitted from two timings `KVTier.calibrate` takes: one block, and
several blocks in one batch. Loading pays when that is less than the prefill's measured time
for the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierSpeed:
    """How fast blocks come back from the tier: a fixed latency plus bytes over a bandwidth,
    fetch, unseal and checks included."""

    latency_ms: float
    bytes_per_s: float

    def load_ms(self, num_bytes: int) -> float:
        """Milliseconds to load `num_bytes` in one batch."""
        return self.latency_ms + num_bytes / self.bytes_per_s * 1000.0

    def cheaper_than(self, num_bytes: int, recompute_ms: float) -> bool:
        """Whether loading `num_bytes` takes less than recomputing them (`recompute_ms`, the
        prefill's measured time for those positions)."""
        return self.load_ms(num_bytes) < recompute_ms

    @classmethod
    def fit(cls, one_ms: float, many_ms: float, blocks: int, block_bytes: int) -> TierSpeed:
        """The line through a load of one block (`one_ms`) and of `blocks` at once (`many_ms`).

        Both stay positive: a noisy pair (the batch no slower than one block) must not make
        loads look free, so a block costs at least a quarter of the batch's mean.
        """
        per_block_ms = max((many_ms - one_ms) / (blocks - 1), many_ms / blocks / 4, 1e-6)
        latency_ms = max(one_ms - per_block_ms, 1e-3)
        return cls(latency_ms, block_bytes / per_block_ms * 1000.0)
