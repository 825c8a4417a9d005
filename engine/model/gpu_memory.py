"""Sizing the KV pool on a CUDA device from a fraction of its memory.

The pool gets what is left of `fraction` of the device's memory once everything already there
(the weights, CUDA's context, other processes' allocations) and the activations of the largest
step the scheduler can build are taken out. The activations are measured: one forward pass of
that step on a scratch pool, its peak allocation read from torch's allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GIB = 1 << 30


def peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """How far `run` raises the memory torch's allocator reserves on `device` (what it holds
    from CUDA, rounding and fragmentation included) above where it started."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_reserved(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_reserved(device)) - start


def kv_cache_budget(device: torch.device, fraction: float, activation_bytes: int) -> int:
    """Bytes for the KV pool: `fraction` of the device's memory, less what is in use now and
    `activation_bytes`. Raises ValueError when nothing is left."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], not {fraction}")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * fraction) - in_use - activation_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_fraction {fraction} of {total / GIB:.1f} GiB leaves nothing for the KV "
            f"cache: {in_use / GIB:.1f} GiB is in use (weights, other processes) and "
            f"activations need {activation_bytes / GIB:.1f} GiB"
        )
    return budget
