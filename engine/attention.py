"""Paged attention, plugged into transformers' own modeling code.

`paged_attention` is registered with transformers' `AttentionInterface` under
`ATTENTION_NAME`. Each architecture (Llama, Qwen2, Mistral, ...) keeps its modeling code:
projections, RoPE at the positions we pass, norms. Only the attention call is ours. It receives
the step's packed (varlen) batch description through the model's forward kwargs, writes the new
K/V into pool slots, and attends over each sequence's block table.

Backends implement `write` and `attend`; the torch reference backend runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "prefixgate_paged"


@dataclass(slots=True)
class PagedBatch:
    """Where one step's tokens live: packed queries, their KV slots and each sequence's blocks.

    Sequences appear in order; sequence `i` contributes `query_lens[i]` tokens to the packed
    batch and, after this step, has `context_lens[i]` tokens of KV in its blocks.
    """

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [total_tokens]: block_id * block_size + offset
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [num_sequences, max_blocks], padded with 0
    backend: AttentionBackend

    @property
    def block_size(self) -> int:
        return int(self.kv_cache.shape[3])


class AttentionBackend(Protocol):
    """How K/V gets into the paged cache and how queries attend over it."""

    name: str

    def write(self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              batch: PagedBatch) -> None: ...  # fmt: skip

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...


class TorchAttention:
    """The reference backend: plain torch, CPU or GPU.

    Decode tokens (one query per sequence) are attended in one padded batch; prefill chunks
    one sequence at a time, with a lower-right causal mask (queries sit at the end of the
    context).
    """

    name = "torch"

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None:
        heads, dim = key.shape[1], key.shape[2]
        layer_kv[0].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, key)
        layer_kv[1].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, value)

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        decode = [i for i, length in enumerate(batch.query_lens) if length == 1]
        starts = _starts(batch.query_lens)
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=query.device)
            output[rows] = self._decode(
                query[rows], layer_kv, batch, decode, scaling, sliding_window
            )
        for index, length in enumerate(batch.query_lens):
            if length > 1:
                start = starts[index]
                output[start : start + length] = self._prefill(
                    query[start : start + length], layer_kv, batch, index, scaling, sliding_window
                )
        return output

    def _prefill(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        index: int,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        context = batch.context_lens[index]
        blocks = batch.block_tables[index, : -(-context // batch.block_size)]
        key = _gather(layer_kv[0], blocks, context)  # [context, kv_heads, dim]
        value = _gather(layer_kv[1], blocks, context)
        query_len = query.shape[0]
        query_positions = torch.arange(context - query_len, context, device=query.device)
        key_positions = torch.arange(context, device=query.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            mask &= key_positions[None, :] > query_positions[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scaling,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _decode(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        rows: list[int],
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        contexts = torch.tensor([batch.context_lens[i] for i in rows], device=query.device)
        max_blocks = -(-int(contexts.max()) // batch.block_size)
        tables = batch.block_tables[rows, :max_blocks]
        length = max_blocks * batch.block_size
        heads, dim = layer_kv.shape[-2], layer_kv.shape[-1]
        key = layer_kv[0][tables].view(len(rows), length, heads, dim).transpose(1, 2)
        value = layer_kv[1][tables].view(len(rows), length, heads, dim).transpose(1, 2)
        positions = torch.arange(length, device=query.device)
        mask = positions[None, :] < contexts[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] >= contexts[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [sequences, heads, 1, dim]
            key,
            value,
            attn_mask=mask[:, None, None, :],
            scale=scaling,
            enable_gqa=True,
        )
        return out[:, :, 0]


def _starts(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts


def _gather(cache: torch.Tensor, blocks: torch.Tensor, context: int) -> torch.Tensor:
    """A sequence's first `context` slots from its blocks: [context, kv_heads, head_dim]."""
    gathered = cache[blocks]  # [blocks, block_size, kv_heads, head_dim]
    return gathered.reshape(-1, *gathered.shape[2:])[:context]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    paged_batch: PagedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for every layer.

    `query` is `[1, heads, tokens, dim]` and `key`/`value` `[1, kv_heads, tokens, dim]` for the
    packed batch, after RoPE at the true positions; returns `[1, tokens, heads, dim]`.
    """
    if paged_batch is None:
        raise RuntimeError(f"{ATTENTION_NAME} needs a paged_batch: run the model via ModelRunner")
    layer_kv = paged_batch.kv_cache[module.layer_idx]  # type: ignore[index]
    packed_query = query[0].transpose(0, 1)
    backend = paged_batch.backend
    backend.write(layer_kv, key[0].transpose(0, 1), value[0].transpose(0, 1), paged_batch)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = backend.attend(packed_query, layer_kv, paged_batch, scale, sliding_window)
    return output.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def make_backend(name: str) -> AttentionBackend:
    """An attention backend by name."""
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; have {', '.join(BACKENDS)}"
        ) from None
