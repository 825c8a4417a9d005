"""Triton kernels: paged decode attention, one query token per sequence.

One program handles one sequence, one KV head and one split of its context: the GQA group's
query heads share every K/V tile it loads (the group is padded to 16 rows for `tl.dot`). Keys
are read in place through the block table, `key_tile` positions per iteration, each
position's block looked up on its own, so any block size works. The softmax runs online in
base 2 (the scale is folded into `scale * log2(e)`).

Long contexts are split across programs (split-K) so that a small batch still fills the
device; each split writes its normalized output and log-sum-exp, and a second kernel merges
the splits. With one split the first kernel writes the output directly. The split count is a
run-time argument: whatever a step needs, the kernels are compiled once per model.

Sequences whose step has more than one query token are left to the prefill kernel: the
grid covers the whole batch and such programs return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

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

SPLIT_ALIGN = 64  # splits cover whole multiples of this many positions
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_starts_ptr,
    context_lens_ptr,
    scale_log2,
    window,
    tokens_per_split,
    num_splits,
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
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HEADS: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    sequence = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + sequence)
    if tl.load(query_starts_ptr + sequence + 1) - query_start != 1:
        return
    context = tl.load(context_lens_ptr + sequence)
    low = 0
    if window > 0:
        low = tl.maximum(context - window, 0)
    split_low = low + split * tokens_per_split
    split_high = tl.minimum(split_low + tokens_per_split, context)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr
        + query_start.to(tl.int64) * stride_qt
        + heads[:, None] * stride_qh
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    table = block_tables_ptr + sequence.to(tl.int64) * stride_table
    key_base = key_cache_ptr + kv_head * stride_kh + dims[None, :]
    value_base = value_cache_ptr + kv_head * stride_vh + dims[None, :]

    best = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(split_low, split_high, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < split_high
        key = load_positions(
            key_base, table, positions, valid, dim_mask, stride_kb, stride_ks, BLOCK_SIZE
        )
        scores = dot(query, tl.trans(key), PRECISION, WIDEN) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        value = load_positions(
            value_base, table, positions, valid, dim_mask, stride_vb, stride_vs, BLOCK_SIZE
        )
        best, total, acc = softmax_step(scores, value, best, total, acc, PRECISION, WIDEN)

    store_mask = row_mask[:, None] & dim_mask[None, :]
    safe_total = tl.where(total == 0.0, 1.0, total)
    output = acc / safe_total[:, None]
    if not SPLIT:
        tl.store(
            out_ptr
            + query_start.to(tl.int64) * stride_ot
            + heads[:, None] * stride_oh
            + dims[None, :],
            output.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials are [sequence, head, split, dim] and [sequence, head, split], contiguous.
        part = (sequence.to(tl.int64) * HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], output, mask=store_mask)
        lse = tl.where(total == 0.0, float("-inf"), best + tl.log2(safe_total))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_starts_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    sequence = tl.program_id(0)
    head = tl.program_id(1)
    query_start = tl.load(query_starts_ptr + sequence)
    if tl.load(query_starts_ptr + sequence + 1) - query_start != 1:
        return
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    part = (sequence.to(tl.int64) * HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    # Split 0 always holds the context's first position, so the largest lse is finite; an
    # empty split has lse -inf and weighs nothing. Each split's output is already normalized.
    weights = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    output = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + query_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
        output.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@dataclass(frozen=True, slots=True)
class Splits:
    """How a step's decode contexts are cut: `count` splits of `tokens` positions."""

    count: int
    tokens: int


def plan_splits(longest_span: int, programs: int, multiprocessors: int) -> Splits:
    """Cut contexts of up to `longest_span` attended positions so that `programs` (sequences x
    KV heads) times the split count fills about two waves of `multiprocessors`, with no split
    shorter than MIN_SPLIT_TOKENS."""
    count = 1
    if programs < 2 * multiprocessors:
        count = min(triton.cdiv(2 * multiprocessors, programs), MAX_SPLITS)
        count = max(1, min(count, longest_span // MIN_SPLIT_TOKENS))
    tokens = triton.cdiv(triton.cdiv(max(longest_span, 1), count), SPLIT_ALIGN) * SPLIT_ALIGN
    return Splits(triton.cdiv(max(longest_span, 1), tokens), tokens)


def decode_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    splits: Splits,
) -> None:
    """Attend every sequence of the batch that has exactly one query token this step.

    `query`/`output`: `[tokens, heads, head_dim]` (last dim contiguous); caches:
    `[blocks, block_size, kv_heads, head_dim]`; `block_tables` int32 `[sequences, max_blocks]`;
    `query_starts` int32 `[sequences + 1]`; `context_lens` int32 `[sequences]`; `window` 0 for
    none. Rows of other sequences are left as they are.
    """
    sequences = block_tables.shape[0]
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    parts = torch.empty(0, device=query.device, dtype=torch.float32)
    lse = parts
    if splits.count > 1:
        parts = torch.empty(
            (sequences, heads, splits.count, head_dim), device=query.device, dtype=torch.float32
        )
        lse = torch.empty(
            (sequences, heads, splits.count), device=query.device, dtype=torch.float32
        )
    _decode_kernel[(sequences, kv_heads, splits.count)](
        output,
        parts,
        lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_starts,
        context_lens,
        scale * LOG2E,
        window,
        splits.tokens,
        splits.count,
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
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_N=key_tile(head_dim, query.dtype),
        SPLIT=splits.count > 1,
        HEADS=heads,
        **product_options(query.dtype),
    )
    if splits.count > 1:
        _merge_splits_kernel[(sequences, heads)](
            output,
            parts,
            lse,
            query_starts,
            splits.count,
            output.stride(0),
            output.stride(1),
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_S=MAX_SPLITS,
        )
