"""Triton kernel: scatter one step's new K and V into their pool slots.

The pool layer is `[K/V, block, slot, kv_head, head_dim]`; `slot_mapping[t]` is
`block * block_size + slot` for packed token `t` (negative: skip the token). One program
writes one token's K and V for all KV heads, casting to the pool's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    target = block * stride_cb + offset * stride_cs + heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` (`[tokens, kv_heads, head_dim]`, last dim contiguous) into the
    caches (`[blocks, block_size, kv_heads, head_dim]`, contiguous) at `slot_mapping`."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    _write_kv_kernel[(tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
