"""Paged attention plugged into transformers' own modeling code: the seam behind which every
attention backend sits.

`paged_attention` is registered with transformers' `AttentionInterface` under
`ATTENTION_NAME`. Each architecture (Llama, Qwen2, Mistral, ...) keeps its modeling code:
projections, RoPE at the positions we pass, norms. Only the attention call is ours. It receives
the step's packed (varlen) batch description (`PagedBatch`) through the model's forward kwargs,
writes the new K/V into pool slots, and attends over each sequence's block table.

Backends implement `AttentionBackend` (`write`, `attend`, `zero_blocks`): `torch`
(`torch_backend.py`, the reference), `cpu` (`cpu_backend.py`, a C++ kernel that reads the
blocks in place) and `triton` (`triton_backend.py`, Triton kernels for CUDA);
`selection.py` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "prefixgate_paged"


@dataclass(slots=True)
class PagedBatch:
    """Where one step's tokens live: packed queries, their KV slots and each sequence's blocks.

    Sequences appear in order; sequence `i` contributes `query_lens[i]` tokens to the packed
    batch and, after this step, has `context_lens[i]` tokens of KV in its blocks.
    """

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [total_tokens] int64: block_id * block_size + offset
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [num_sequences, max_blocks] int32, padded with own blocks
    query_starts: torch.Tensor  # [num_sequences + 1] int32: where each sequence's tokens begin
    context_lens_tensor: torch.Tensor  # [num_sequences] int32
    backend: AttentionBackend
    # Per sequence, int32: decoding sequences of one group whose tables begin with the same
    # blocks may read those blocks together (engine/kernels/cpu/paged_attention.cpp); -1 never
    # does. The model runner gives each tenant a group of its own. None: none is grouped.
    share_groups: torch.Tensor | None = None
    # Per sequence, int32: 1 where its chunk computes prompt positions. The CPU kernel runs
    # those on its matrix path at any length, so a prompt rounds the same whether its
    # beginning came from the cache or not. None: decided by length alone.
    prompt_chunks: torch.Tensor | None = None
    # Backends keep per-step indexing here, built by the first layer, reused by the rest.
    plans: dict[Any, Any] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return int(self.kv_cache.shape[3])


class AttentionBackend(Protocol):
    """How K/V gets into the paged cache, how queries attend over it, and how freed blocks
    are wiped."""

    name: str

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...

    def zero_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> None: ...


def write_kv(
    layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
) -> None:
    """Scatter the step's new K and V (`[tokens, kv_heads, dim]`) into their pool slots."""
    heads, dim = key.shape[1], key.shape[2]
    layer_kv[0].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, key)
    layer_kv[1].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, value)


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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = write_and_attend(
        paged_batch,
        int(module.layer_idx),  # type: ignore[arg-type]
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scale,
        sliding_window,
    )
    return output.unsqueeze(0), None


def write_and_attend(
    batch: PagedBatch,
    layer_index: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One layer's paged attention on the batch's backend: the new K/V (`[tokens, kv_heads,
    dim]`) into their pool slots, then `query` (`[tokens, heads, dim]`) over each sequence's
    blocks; returns `[tokens, heads, dim]`."""
    layer_kv = batch.kv_cache[layer_index]
    batch.backend.write(layer_kv, key, value, batch)
    return batch.backend.attend(query, layer_kv, batch, scaling, sliding_window)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
