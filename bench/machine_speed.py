"""How fast this machine computes and moves memory right now, in about a third of a second.

The machines the benches run on change speed by up to 2x within minutes (a virtual machine
gets what its host leaves it), and a bench's JSON that records only the CPU's model and flags
cannot tell a slow minute from a slow build. `Prober.probe()` times fixed operations that
bound an inference engine's steps on a CPU: a matrix product the shape of the embedded model's
gate-and-up projection over a 1,536-token prefill (compute-bound), and passes over a buffer
larger than the biggest last-level caches seen here (480 MB; memory-bound, as a many-stream
decode is): one that reads and writes each element in place, and one that only reads (a sum),
as a decode step reads its weights and K/V. The two rates differ: on an AMD EPYC (Zen 4, 2
vCPUs, 2026-12-04) the in-place pass moved 40-96 GB/s, reads and writes counted, while reads
alone came at 21-60 GB/s within minutes (a core read about 16 GB/s by itself). A bench probes
between its phases and reports the range, so that a reader compares its engines' numbers with
how fast the machine was while they were taken.

The buffer is in 2 MB pages where Linux gives them (`engine/huge_pages.py`), as the engine's
weights and KV pool are (in 4 KB pages the sum read 27 GB/s there, in 2 MB pages 33). The
passes leave the caches empty, as any engine's turn leaves them for the next (a model's
weights and activations are hundreds of MB).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from engine import huge_pages

MATMUL_SHAPE = (1536, 576, 3072)  # tokens x hidden x (gate + up) of SmolLM2-135M
PASS_BYTES = 512 << 20  # read and written in place per pass: 1 GiB of traffic
MATMUL_BUDGET_S = 0.1  # repeat the product for this long and take the median call
PASSES = 3


@dataclass(frozen=True, slots=True)
class Speed:
    """One probe's median rates: matrix product TFLOP/s, memory GB/s (read + write, in place),
    memory GB/s read alone."""

    matmul_tflops: float
    memory_gb_s: float
    read_gb_s: float


def product_dtype(engine_dtype: torch.dtype, native_bf16: bool) -> torch.dtype:
    """The dtype of the probe's product for engines computing in `engine_dtype`: bf16 only where
    the CPU computes it natively. Elsewhere torch's bf16 product is a fallback that says nothing
    of the machine (this shape at 1 GFLOP/s on an AMD EPYC with AVX2, five seconds a probe,
    while PrefixGate's own bf16 products ran at 160), so the probe takes fp32 there."""
    if engine_dtype == torch.bfloat16 and not native_bf16:
        return torch.float32
    return engine_dtype


def rates(
    shape: tuple[int, int, int], product_s: float, nbytes: int, pass_s: float, read_s: float
) -> Speed:
    """The rates of one product of `shape` (rows x inner x columns) taking `product_s`, one
    in-place pass over `nbytes` taking `pass_s` and one read of them taking `read_s`."""
    rows, inner, columns = shape
    return Speed(
        matmul_tflops=2 * rows * inner * columns / product_s / 1e12,
        memory_gb_s=2 * nbytes / pass_s / 1e9,
        read_gb_s=nbytes / read_s / 1e9,
    )


class Prober:
    """Holds the probe's operands (PASS_BYTES for the memory pass), allocated once, so that
    each probe times the operations and not the allocator."""

    def __init__(
        self,
        dtype: torch.dtype,
        shape: tuple[int, int, int] = MATMUL_SHAPE,
        pass_bytes: int = PASS_BYTES,
    ) -> None:
        self.dtype, self.shape = dtype, shape
        rows, inner, columns = shape
        generator = torch.Generator().manual_seed(0)
        self.left = torch.randn(rows, inner, generator=generator).to(dtype)
        self.right = torch.randn(inner, columns, generator=generator).to(dtype)
        self.buffer = huge_pages.empty((pass_bytes // 4,), torch.float32)
        self.buffer.fill_(1.0)  # every page touched
        torch.mm(self.left, self.right)  # let torch choose its kernel before timing

    def describe(self) -> str:
        """The matrix product timed, e.g. "1536x576x3072 bfloat16"."""
        return "x".join(map(str, self.shape)) + " " + str(self.dtype).removeprefix("torch.")

    def probe(self) -> Speed:
        """Time the product (repeated for MATMUL_BUDGET_S), PASSES in-place passes over the
        buffer and PASSES reads of it; their medians as rates."""
        product: list[float] = []
        started = time.perf_counter()
        while not product or time.perf_counter() - started < MATMUL_BUDGET_S:
            began = time.perf_counter()
            torch.mm(self.left, self.right)
            product.append(time.perf_counter() - began)
        in_place = median_seconds(lambda: self.buffer.mul_(1.0))  # each element read, written
        read = median_seconds(self.buffer.sum)  # each element read
        nbytes = self.buffer.numel() * self.buffer.element_size()
        return rates(self.shape, statistics.median(product), nbytes, in_place, read)


def median_seconds(operation: Callable[[], object]) -> float:
    """The median time of PASSES calls of `operation`."""
    times = []
    for _ in range(PASSES):
        began = time.perf_counter()
        operation()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def summary(speeds: list[Speed]) -> dict[str, list[float]]:
    """Each rate's least, median and most over `speeds`, to three significant digits."""
    report = {}
    for name in (field.name for field in fields(Speed)):
        values = sorted(getattr(speed, name) for speed in speeds)
        middle = statistics.median(values)
        report[name] = [float(f"{v:.3g}") for v in (values[0], middle, values[-1])]
    return report


def typical(speeds: list[Speed]) -> Speed:
    """Each rate's median over `speeds` (not rounded)."""
    rates = {
        field.name: [getattr(speed, field.name) for speed in speeds] for field in fields(Speed)
    }
    return Speed(**{name: statistics.median(values) for name, values in rates.items()})
