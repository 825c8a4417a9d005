"""Sizing the KV pool on a CUDA device from a fraction of its memory.

The pool gets what is left of `fraction` of the device's memory once everything already there
(the weights, CUDA's context, other processes' allocations) and the activations of the largest
step the scheduler can build are taken out. The activations are measured: one forward pass of
that step on a scratch pool, its peak allocation read from torch's allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine.attention.paged import AttentionBackend
from engine.cache.block_pool import BlockPool
from engine.cache.kv_spec import KVSpec
from engine.math_utils import cdiv
from engine.model.runner import Chunk, ModelRunner

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


def largest_step_bytes(
    model: PreTrainedModel,
    spec: KVSpec,
    backend: AttentionBackend,
    token_budget: int,
    max_model_len: int,
) -> int:
    """Peak memory of the largest step: `token_budget` tokens of prefill, in as many
    sequences as `max_model_len` requires, on a scratch pool of its own (freed on return)."""
    device = next(model.parameters()).device
    lengths = [
        min(max_model_len, token_budget - start) for start in range(0, token_budget, max_model_len)
    ]
    tables, first = [], 0
    for length in lengths:
        tables.append(list(range(first, first + cdiv(length, spec.block_size))))
        first += len(tables[-1])
    runner = ModelRunner(model, BlockPool(spec, first, device).kv, backend)
    chunks = [
        Chunk(
            request_id=f"memory-profile-{index}",
            token_ids=[0] * length,
            start=0,
            block_ids=table,
            prompt_positions=0,
            needs_logits=True,
        )
        for index, (length, table) in enumerate(zip(lengths, tables, strict=True))
    ]
    return peak_bytes(device, lambda: runner.run(chunks))
