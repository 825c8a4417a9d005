"""Triton kernel benchmark on a CUDA device: what each kernel achieves against the hardware.

    python -m bench.gpu_kernels [--json] [--out F] [--smoke]

- decode: paged decode attention for 32 sequences x 4,096 tokens of context (32 query heads,
  8 KV heads, head_dim 128, bf16, 16-token blocks scattered over the pool); bytes of K and V
  read per call over its time, as GB/s and as a share of the device's peak memory bandwidth
  (from its memory clock and bus width) and of a device-to-device copy measured here.
- prefill / extend: causal prefill of 4 x 4,096 new tokens, and 8 x 1,024 new tokens over
  3,072 cached ones; FLOPs counted over the visible (query, key) pairs only, in TFLOP/s.
- zeroing: half the blocks of a 30-layer pool zeroed by the Triton kernel, against
  `torch.zero_` of the same number of contiguous bytes (a memset) and against `index_fill_`
  (the torch backend's way).

Times are medians of `triton.testing.do_bench` (CUDA events). `--smoke` runs tiny shapes on
whatever device there is (the CPU in Triton's interpreter), timed by the wall clock: it checks
that the benchmark runs, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from bench.common import emit, machine
from engine.kernels.triton.decode import decode_attention, plan_splits
from engine.kernels.triton.prefill import prefill_attention
from engine.kernels.triton.zero import zero_blocks

GB = 1e9
# (query, key cache, value cache, block tables, query starts, context lengths)
PagedInputs = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


@dataclass(frozen=True)
class Shapes:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    decode_sequences: int = 32
    decode_context: int = 4096
    prefill: tuple[tuple[int, int], ...] = ((4096, 4096),) * 4  # (new tokens, context)
    extend: tuple[tuple[int, int], ...] = ((1024, 4096),) * 8
    zero_layers: int = 30
    zero_blocks: int = 4096
    copy_bytes: int = 1 << 30


SMOKE = Shapes(
    heads=4, kv_heads=2, head_dim=32, decode_sequences=2, decode_context=100,
    prefill=((40, 40),), extend=((20, 70),), zero_layers=2, zero_blocks=8, copy_bytes=1 << 16,
)  # fmt: skip


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call takes: the median of do_bench on CUDA, one wall-clock call elsewhere."""
    if device.type == "cuda":
        return lambda call: float(triton.testing.do_bench(call, return_mode="median")) / 1e3

    def wall(call: Callable[[], object]) -> float:
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    return wall


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth in bytes/s (double data rate x bus width), if the
    driver tells its memory clock and bus width."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    if not (clock_khz and bus_bits):
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            clock_khz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM) * 1000
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        except Exception:  # no NVML: the share of the copy bandwidth still stands
            return None
    return 2 * clock_khz * 1e3 * bus_bits / 8


def copy_bandwidth(device: torch.device, shapes: Shapes, seconds: Callable[..., float]) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    source = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / seconds(lambda: target.copy_(source))


def paged_inputs(
    device: torch.device, shapes: Shapes, lengths: list[tuple[int, int]]
) -> PagedInputs:
    """Queries and a bf16 pool for sequences given as (new tokens, context), blocks shuffled."""
    table_len = max(triton.cdiv(context, shapes.block_size) for _, context in lengths)
    blocks = len(lengths) * table_len + 64
    shape = (blocks, shapes.block_size, shapes.kv_heads, shapes.head_dim)
    order = torch.randperm(blocks, device=device)[: len(lengths) * table_len]
    starts = [0]
    for new, _ in lengths:
        starts.append(starts[-1] + new)
    query_shape = (starts[-1], shapes.heads, shapes.head_dim)
    return (
        torch.randn(query_shape, device=device, dtype=torch.bfloat16),
        torch.randn(shape, device=device, dtype=torch.bfloat16),
        torch.randn(shape, device=device, dtype=torch.bfloat16),
        order.view(len(lengths), table_len).int(),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor([context for _, context in lengths], dtype=torch.int32, device=device),
    )


def bench_decode(
    device: torch.device, shapes: Shapes, seconds: Callable[..., float], copy: float
) -> dict[str, Any]:
    sequences, context = shapes.decode_sequences, shapes.decode_context
    inputs = paged_inputs(device, shapes, [(1, context)] * sequences)
    output = torch.empty_like(inputs[0])
    splits = plan_splits([context] * sequences)
    scale = shapes.head_dim**-0.5
    took = seconds(lambda: decode_attention(output, *inputs, scale, 0, splits))
    kv_bytes = 2 * sequences * context * shapes.kv_heads * shapes.head_dim * 2
    bandwidth = kv_bytes / took
    peak = peak_bandwidth(device)
    return {
        "shape": f"{sequences} sequences x {context} context, heads {shapes.heads}/"
        f"{shapes.kv_heads}, head_dim {shapes.head_dim}, bf16, block {shapes.block_size}",
        "splits": splits,
        "microseconds": took * 1e6,
        "gb_per_s": bandwidth / GB,
        "peak_gb_per_s": peak / GB if peak else None,
        "percent_of_peak": 100 * bandwidth / peak if peak else None,
        "percent_of_copy": 100 * bandwidth / copy,
    }


def bench_prefill(
    device: torch.device,
    shapes: Shapes,
    seconds: Callable[..., float],
    lengths: tuple[tuple[int, int], ...],
) -> dict[str, Any]:
    inputs = paged_inputs(device, shapes, list(lengths))
    output = torch.empty_like(inputs[0])
    longest = max(new for new, _ in lengths)
    scale = shapes.head_dim**-0.5
    took = seconds(lambda: prefill_attention(output, *inputs, scale, 0, longest))
    # Visible pairs: each new token sees the cached context and the new tokens up to itself.
    pairs = sum(new * (context - new) + new * (new + 1) // 2 for new, context in lengths)
    flops = 4 * shapes.heads * shapes.head_dim * pairs  # QK^T and PV, a multiply-add each
    new, context = lengths[0]
    return {
        "shape": f"{len(lengths)} x {new} new tokens over {context - new} cached",
        "milliseconds": took * 1e3,
        "tflop_per_s": flops / took / 1e12,
    }


def bench_zeroing(
    device: torch.device, shapes: Shapes, seconds: Callable[..., float]
) -> dict[str, Any]:
    layers, blocks = shapes.zero_layers, shapes.zero_blocks
    block = (shapes.block_size, shapes.kv_heads, shapes.head_dim)
    kv = torch.ones(layers, 2, blocks, *block, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(blocks, device=device)[: blocks // 2]
    zeroed = layers * 2 * ids.numel() * kv[0, 0, 0].numel() * kv.element_size()
    flat = torch.empty(zeroed, dtype=torch.uint8, device=device)
    kernel = seconds(lambda: zero_blocks(kv, ids))
    memset = seconds(lambda: flat.zero_())
    fill = seconds(lambda: kv.index_fill_(2, ids, 0))
    return {
        "shape": f"{ids.numel()} of {blocks} blocks x {layers} layers, K and V, "
        f"{zeroed / GB:.2f} GB",
        "kernel_gb_per_s": zeroed / kernel / GB,
        "memset_gb_per_s": zeroed / memset / GB,
        "index_fill_gb_per_s": zeroed / fill / GB,
        "percent_of_memset": 100 * memset / kernel,
    }


def run(smoke: bool = False) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if smoke else Shapes()
    seconds = timer(device)
    torch.manual_seed(0)
    copy = copy_bandwidth(device, shapes, seconds)
    return {
        "benchmark": "gpu_kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "smoke": smoke,
        "copy_gb_per_s": copy / GB,
        "decode": bench_decode(device, shapes, seconds, copy),
        "prefill": bench_prefill(device, shapes, seconds, shapes.prefill),
        "extend": bench_prefill(device, shapes, seconds, shapes.extend),
        "zeroing": bench_zeroing(device, shapes, seconds),
        "triton": triton.__version__,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    args = parser.parse_args(argv)
    if not (args.smoke or torch.cuda.is_available()):
        parser.exit(2, "bench.gpu_kernels: no CUDA device here (--smoke runs tiny shapes)\n")
    result = run(args.smoke)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
