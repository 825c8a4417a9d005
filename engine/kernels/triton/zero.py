"""Triton kernel: zero a list of KV blocks in every layer, K and V, in one launch.

Zeroing freed blocks is the price of the guarantee that no tenant reads another's residue, so
it should cost what a memset costs: each program stores one contiguous run of zeros (a block's
`slot x kv_head x head_dim` elements are contiguous in the pool), with 64-bit offsets since a
GPU pool passes 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_RUN = 8192  # elements one program zeroes


@triton.jit
def _zero_blocks_kernel(
    kv_ptr,
    block_ids_ptr,
    stride_plane,
    stride_block,
    BLOCK_ELEMENTS: tl.constexpr,
    RUN: tl.constexpr,
):
    block = tl.load(block_ids_ptr + tl.program_id(0)).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    offsets = tl.program_id(2) * RUN + tl.arange(0, RUN)
    base = kv_ptr + plane * stride_plane + block * stride_block
    zeros = tl.zeros([RUN], dtype=kv_ptr.dtype.element_ty)
    tl.store(base + offsets, zeros, mask=offsets < BLOCK_ELEMENTS)


def zero_blocks(kv: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Zero blocks `block_ids` (int, on kv's device) of the pool
    `kv[layer, K/V, block, slot, kv_head, head_dim]` (contiguous)."""
    if block_ids.numel() == 0:
        return
    if not kv.is_contiguous():
        raise ValueError("the KV pool must be contiguous")
    layers, _, num_blocks = kv.shape[:3]
    planes = kv.view(layers * 2, num_blocks, -1)
    block_elements = planes.shape[2]
    run = min(_MAX_RUN, triton.next_power_of_2(block_elements))
    grid = (block_ids.numel(), layers * 2, triton.cdiv(block_elements, run))
    _zero_blocks_kernel[grid](
        planes,
        block_ids,
        planes.stride(0),
        planes.stride(1),
        BLOCK_ELEMENTS=block_elements,
        RUN=run,
    )
