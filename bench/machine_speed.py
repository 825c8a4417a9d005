"""How fast this machine computes and moves memory right now, in about a quarter of a second.

The machines the benches run on change speed by up to 2x within minutes (a virtual machine
gets what its host leaves it), and a bench's JSON that records only the CPU's model and flags
cannot tell a slow minute from a slow build. `probe()` times two fixed operations that bound
an inference engine's steps on a CPU: a matrix product the shape of the embedded model's
gate-and-up projection over a 1,536-token prefill (compute-bound), and a copy larger than
the biggest last-level caches seen here (480 MB; memory-bound, as a many-stream decode is).
A bench probes between its phases and reports the range, so that a reader compares its
engines' numbers with how fast the machine was while they were taken.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

MATMUL_SHAPE = (1536, 576, 3072)  # tokens x hidden x (gate + up) of SmolLM2-135M
COPY_BYTES = 512 << 20  # read once and written once per copy: 1 GiB of traffic
MATMUL_BUDGET_S = 0.1  # repeat the product for this long and take the median call


@dataclass(frozen=True, slots=True)
class Speed:
    """Median rates of one probe: `dtype` matrix product TFLOP/s, copy GB/s (read + write)."""

    matmul_tflops: float
    copy_gb_s: float


class Prober:
    """Holds the probe's operands (1 GiB for the copy), allocated once, so that each probe
    times the operations and not the allocator."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        tokens, hidden, width = MATMUL_SHAPE
        generator = torch.Generator().manual_seed(0)
        self.left = torch.randn(tokens, hidden, generator=generator).to(dtype)
        self.right = torch.randn(hidden, width, generator=generator).to(dtype)
        self.source = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
        self.target = torch.empty_like(self.source)
        self.target.copy_(self.source)  # touch every page before timing
        torch.mm(self.left, self.right)  # and let torch choose its kernel

    def describe(self) -> str:
        """The matrix product timed, e.g. "1536x576x3072 bfloat16"."""
        return "x".join(map(str, MATMUL_SHAPE)) + " " + str(self.dtype).removeprefix("torch.")

    def probe(self) -> Speed:
        product: list[float] = []
        started = time.perf_counter()
        while not product or time.perf_counter() - started < MATMUL_BUDGET_S:
            began = time.perf_counter()
            torch.mm(self.left, self.right)
            product.append(time.perf_counter() - began)
        copies = []
        for _ in range(3):
            began = time.perf_counter()
            self.target.copy_(self.source)
            copies.append(time.perf_counter() - began)
        tokens, hidden, width = MATMUL_SHAPE
        return Speed(
            matmul_tflops=2 * tokens * hidden * width / statistics.median(product) / 1e12,
            copy_gb_s=2 * COPY_BYTES / statistics.median(copies) / 1e9,
        )


def summary(speeds: list[Speed]) -> dict[str, list[float]]:
    """Each rate's least, median and most over `speeds`, rounded for reading."""
    report = {}
    for name in ("matmul_tflops", "copy_gb_s"):
        values = sorted(getattr(speed, name) for speed in speeds)
        report[name] = [round(v, 2) for v in (values[0], statistics.median(values), values[-1])]
    return report
