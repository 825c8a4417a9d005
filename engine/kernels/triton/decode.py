"""Triton kernels: paged decode attention, one query token per sequence.

One program handles one sequence, one KV head and one split of its context: the GQA group's
query heads share every K/V tile it loads (the group is padded to 16 rows for `tl.dot`). Keys
are read in place through the block table, `key_tile` positions per iteration, each
position's block looked up on its own, so any block size works. The softmax runs online in
base 2 (the scale is folded into `scale * log2(e)`).

Long contexts are split across programs (split-K); each split writes its normalized output and
log-sum-exp, and a second kernel merges the splits. How a sequence is cut depends on that
sequence alone, never on the batch: its split size comes from its own attended span
(`split_tokens`: SPLIT_TOKENS positions, more only where that would take over MAX_SPLITS
splits), counted from its own first attended position. So a sequence's reduction order, and
with it every bit of its output, is the same whatever shares its step (batch invariance): its
splits cover the same positions, a sequence of one split writes its output directly in every
grid (the merge leaves it alone), and the merge reduces over a fixed tile of MAX_SPLITS splits
in which a sequence's own splits are the only ones not masked to zero. The grid's split
dimension is the most splits any sequence of the step needs (`plan_splits`, from the lengths
the host has); the programs past a sequence's own splits return at once. The split count is a
run-time argument kept out of Triton's specialization, so every grid runs the same compiled
kernels, and they are compiled once per model.

The price of invariance: a large batch of long contexts is cut as finely as a lone sequence
(more programs and partials to merge) where a batch-sized plan would not have split it.

Sequences whose step has more than one query token are left to the prefill kernel: the
grid covers the whole batch and such programs return at once.
"""

from __future__ import annotations

from collections.abc import Iterable

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
SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it saves
MAX_SPLITS = 64  # the merge's tile: no sequence is cut into more splits

# The same numbers for the kernels (a jitted function reads only constexpr globals).
_SPLIT_ALIGN = tl.constexpr(SPLIT_ALIGN)
_SPLIT_TOKENS = tl.constexpr(SPLIT_TOKENS)
_MAX_SPLITS = tl.constexpr(MAX_SPLITS)


def split_tokens(span: int) -> int:
    """Positions per split of a sequence attending `span` positions: SPLIT_TOKENS, or as many
    whole SPLIT_ALIGN tiles as keep it to MAX_SPLITS splits (`_own_splits` in the kernels)."""
    aligned = int(triton.cdiv(triton.cdiv(span, MAX_SPLITS), SPLIT_ALIGN)) * SPLIT_ALIGN
    return max(SPLIT_TOKENS, aligned)


def split_count(span: int) -> int:
    """How many splits a sequence attending `span` positions is cut into (at least 1)."""
    return max(1, int(triton.cdiv(span, split_tokens(span))))


def plan_splits(spans: Iterable[int]) -> int:
    """The decode grid's split dimension for a step whose decoding sequences attend `spans`
    positions (their contexts, cut to the sliding window): the most splits any one needs."""
    return max((split_count(span) for span in spans), default=1)


@triton.jit
def _own_splits(context, window):
    """A sequence's first attended position, split size and split count, from its context
    length and the window alone (as `split_tokens` and `split_count` on the host)."""
    low = 0
    if window > 0:
        low = tl.maximum(context - window, 0)
    span = context - low
    per = tl.cdiv(tl.cdiv(span, _MAX_SPLITS), _SPLIT_ALIGN) * _SPLIT_ALIGN
    per = tl.maximum(per, _SPLIT_TOKENS)
    count = tl.maximum(tl.cdiv(span, per), 1)
    return low, per, count


# `num_splits` (the grid's split dimension) is left out of Triton's specialization on values
# (1, multiples of 16): every grid then runs the same compiled kernel, so nothing a sequence
# computes depends on how many splits the rest of its batch needs.
@triton.jit(do_not_specialize=["num_splits"])
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
    low, per, count = _own_splits(context, window)
    if split >= count:  # past this sequence's own splits (others in the batch need more)
        return
    split_low = low + split * per
    split_high = tl.minimum(split_low + per, context)

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
    if count == 1:
        # One split: the output, directly, in every grid (the merge skips this sequence).
        tl.store(
            out_ptr
            + query_start.to(tl.int64) * stride_ot
            + heads[:, None] * stride_oh
            + dims[None, :],
            output.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials are [sequence, head, split, dim] and [sequence, head, split], contiguous;
        # every split below `count` holds at least one position, so its lse is finite.
        part = (sequence.to(tl.int64) * HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], output, mask=store_mask)
        lse = best + tl.log2(safe_total)
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_starts_ptr,
    context_lens_ptr,
    window,
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
    _, _, count = _own_splits(tl.load(context_lens_ptr + sequence), window)
    if count == 1:  # the decode kernel wrote its output
        return
    # The sequence's own splits, in a tile of BLOCK_S (MAX_SPLITS) whatever the grid: the
    # rest are masked to lse -inf (weight 0) and output 0, so the sums below add the same
    # values in the same order in every batch.
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < count
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    part = (sequence.to(tl.int64) * HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    # Each split's output is already normalized; the largest lse is finite (no split below
    # `count` is empty).
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
    splits: int,
) -> None:
    """Attend every sequence of the batch that has exactly one query token this step.

    `query`/`output`: `[tokens, heads, head_dim]` (last dim contiguous); caches:
    `[blocks, block_size, kv_heads, head_dim]`; `block_tables` int32 `[sequences, max_blocks]`;
    `query_starts` int32 `[sequences + 1]`; `context_lens` int32 `[sequences]`; `window` 0 for
    none; `splits` the grid's split dimension, at least `plan_splits` of the decoding
    sequences' spans (more only adds programs that return at once). Rows of other sequences
    are left as they are.
    """
    sequences = block_tables.shape[0]
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    parts = torch.empty(0, device=query.device, dtype=torch.float32)
    lse = parts
    if splits > 1:
        parts = torch.empty(
            (sequences, heads, splits, head_dim), device=query.device, dtype=torch.float32
        )
        lse = torch.empty((sequences, heads, splits), device=query.device, dtype=torch.float32)
    _decode_kernel[(sequences, kv_heads, splits)](
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
        splits,
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
        HEADS=heads,
        **product_options(query.dtype),
    )
    if splits > 1:
        _merge_splits_kernel[(sequences, heads)](
            output,
            parts,
            lse,
            query_starts,
            context_lens,
            window,
            splits,
            output.stride(0),
            output.stride(1),
            HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_S=MAX_SPLITS,
        )
