"""The `torch` attention backend: the reference, plain torch ops, on a CPU or a GPU.

It runs anywhere torch does, and gathers each sequence's blocks out of the pool for every
layer (the `cpu` and `triton` backends read them in place). Decode tokens (one query per
sequence) are attended in one padded batch; prefill chunks one sequence at a time, with a
lower-right causal mask (queries sit at the end of the context). The indexing plan is built
once per step, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.paged import PagedBatch, write_kv
from engine.cache.block_pool import fill_zero
from engine.math_utils import cdiv


@dataclass(slots=True)
class _Prefill:
    start: int
    length: int
    blocks: torch.Tensor
    context: int
    mask: torch.Tensor | None  # None: plain causal (no cached context, no window)


@dataclass(slots=True)
class _Plan:
    """Per-step indexing shared by every layer with the same sliding window."""

    decode_rows: torch.Tensor | None
    decode_blocks: torch.Tensor | None  # [sequences * max_blocks], flattened
    decode_mask: torch.Tensor | None  # [sequences, 1, 1, max_blocks * block_size]
    prefills: list[_Prefill]


class TorchAttention:
    """The reference backend: gathers with `index_select` over K and V together, then
    torch's scaled dot-product attention."""

    name = "torch"

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None:
        write_kv(layer_kv, key, value, batch)

    def zero_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> None:
        fill_zero(kv, block_ids)

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        plan = batch.plans.get(sliding_window)
        if plan is None:
            plan = batch.plans[sliding_window] = _make_plan(batch, sliding_window)
        output = torch.empty_like(query)
        if plan.decode_rows is not None:
            output[plan.decode_rows] = self._decode(
                query[plan.decode_rows], layer_kv, plan, scaling
            )
        for prefill in plan.prefills:
            rows = slice(prefill.start, prefill.start + prefill.length)
            output[rows] = self._prefill(query[rows], layer_kv, prefill, scaling)
        return output

    def _prefill(
        self, query: torch.Tensor, layer_kv: torch.Tensor, prefill: _Prefill, scaling: float
    ) -> torch.Tensor:
        gathered = layer_kv.index_select(1, prefill.blocks)  # [2, blocks, slots, heads, dim]
        heads, dim = gathered.shape[-2], gathered.shape[-1]
        key_value = gathered.view(2, -1, heads, dim)[:, : prefill.context].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key_value[0].unsqueeze(0),
            key_value[1].unsqueeze(0),
            attn_mask=prefill.mask,
            is_causal=prefill.mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _decode(
        self, query: torch.Tensor, layer_kv: torch.Tensor, plan: _Plan, scaling: float
    ) -> torch.Tensor:
        assert plan.decode_blocks is not None and plan.decode_mask is not None
        sequences = query.shape[0]
        gathered = layer_kv.index_select(1, plan.decode_blocks)
        heads, dim = gathered.shape[-2], gathered.shape[-1]
        key_value = gathered.view(2, sequences, -1, heads, dim).transpose(2, 3)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [sequences, heads, 1, dim]
            key_value[0],
            key_value[1],
            attn_mask=plan.decode_mask,
            scale=scaling,
            enable_gqa=True,
        )
        return out[:, :, 0]


def _make_plan(batch: PagedBatch, sliding_window: int | None) -> _Plan:
    device = batch.block_tables.device
    block_size = batch.block_size
    starts = _starts(batch.query_lens)
    decode = [i for i, length in enumerate(batch.query_lens) if length == 1]
    decode_rows: torch.Tensor | None = None
    decode_blocks: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    if decode:
        decode_rows = torch.tensor([starts[i] for i in decode], device=device)
        decode_contexts = [batch.context_lens[i] for i in decode]
        contexts = torch.tensor(decode_contexts, device=device)
        max_blocks = cdiv(max(decode_contexts), block_size)  # from the host: no device read
        decode_blocks = batch.block_tables[decode, :max_blocks].reshape(-1)
        positions = torch.arange(max_blocks * block_size, device=device)
        mask = positions[None, :] < contexts[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] >= contexts[:, None] - sliding_window
        decode_mask = _additive(mask[:, None, None, :], batch.kv_cache.dtype)
    prefills = []
    for index, length in enumerate(batch.query_lens):
        if length == 1:
            continue
        context = batch.context_lens[index]
        blocks = batch.block_tables[index, : cdiv(context, block_size)]
        prefill_mask: torch.Tensor | None = None
        if context != length or sliding_window is not None:
            query_positions = torch.arange(context - length, context, device=device)
            key_positions = torch.arange(context, device=device)
            prefill_mask = key_positions[None, :] <= query_positions[:, None]
            if sliding_window is not None:
                prefill_mask &= key_positions[None, :] > query_positions[:, None] - sliding_window
        if prefill_mask is not None:
            prefill_mask = _additive(prefill_mask, batch.kv_cache.dtype)
        prefills.append(_Prefill(starts[index], length, blocks, context, prefill_mask))
    return _Plan(decode_rows, decode_blocks, decode_mask, prefills)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as an additive one (0 or -inf), which CPU SDPA runs faster."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _starts(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts
