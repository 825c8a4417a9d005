"""Triton kernel: paged prefill / extend attention over a packed (varlen) batch.

Each sequence brings `query_len > 1` new tokens (its last positions) and attends causally to
its whole context, cached prefix and new tokens alike, read in place through its block table:
the new K/V were written to the pool before this kernel runs. One program handles `BLOCK_M`
query rows of one sequence for one query head (GQA: its KV head is `head // group`), with an
online softmax in base 2 and an optional sliding window. Sequences with a single query token
are the decode kernel's; their programs return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (
    LOG2E,
    dot,
    key_tile,
    load_positions,
    product_options,
    softmax_step,
)

BLOCK_M = 64  # query rows per program


@triton.jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_starts_ptr,
    context_lens_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    sequence = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + sequence)
    query_len = tl.load(query_starts_ptr + sequence + 1) - query_start
    if query_len <= 1 or tile * BLOCK_M >= query_len:
        return
    context = tl.load(context_lens_ptr + sequence)
    first_position = context - query_len  # position of the sequence's first new token

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    query_positions = first_position + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_offsets = (query_start + rows).to(tl.int64)
    query = tl.load(
        query_ptr + row_offsets[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    kv_head = head // GROUP
    table = block_tables_ptr + sequence.to(tl.int64) * stride_table
    key_base = key_cache_ptr + kv_head * stride_kh + dims[None, :]
    value_base = value_cache_ptr + kv_head * stride_vh + dims[None, :]

    # Keys this tile can see: up to its last row's position, from its first row's window.
    high = tl.minimum(context, first_position + (tile + 1) * BLOCK_M)
    low = 0
    if window > 0:
        low = tl.maximum(first_position + tile * BLOCK_M - window + 1, 0)

    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(low, high, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < high
        key = load_positions(
            key_base, table, positions, valid, dim_mask, stride_kb, stride_ks, BLOCK_SIZE
        )
        scores = dot(query, tl.trans(key), PRECISION, WIDEN) * scale_log2
        visible = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        if window > 0:
            visible = visible & (positions[None, :] > query_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        value = load_positions(
            value_base, table, positions, valid, dim_mask, stride_vb, stride_vs, BLOCK_SIZE
        )
        best, total, acc = softmax_step(scores, value, best, total, acc, PRECISION, WIDEN)

    output = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + row_offsets[:, None] * stride_ot + head * stride_oh + dims[None, :],
        output.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def prefill_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    longest_query: int,
) -> None:
    """Attend every sequence of the batch that has more than one query token this step.

    Shapes as `decode.decode_attention`; `longest_query` is the batch's longest
    query_len (known on the host, so the grid needs no device read).
    """
    sequences = block_tables.shape[0]
    heads, head_dim = query.shape[1], query.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    grid = (sequences, heads, triton.cdiv(longest_query, BLOCK_M))
    _prefill_kernel[grid](
        output,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_starts,
        context_lens,
        scale * LOG2E,
        window,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        GROUP=heads // key_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=BLOCK_M,
        BLOCK_N=key_tile(head_dim, query.dtype),
        **product_options(query.dtype),
    )
