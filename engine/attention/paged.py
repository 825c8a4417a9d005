"""Paged attention, plugged into transformers' own modeling code.

`paged_attention` is registered with transformers' `AttentionInterface` under
`ATTENTION_NAME`. Each architecture (Llama, Qwen2, Mistral, ...) keeps its modeling code:
projections, RoPE at the positions we pass, norms. Only the attention call is ours. It receives
the step's packed (varlen) batch description through the model's forward kwargs, writes the new
K/V into pool slots, and attends over each sequence's block table.

Backends implement `write`, `attend` and `zero_blocks`: `torch` (the reference, plain torch
ops, runs anywhere; it gathers each sequence's blocks per layer), `cpu`
(`engine/attention/cpu_backend.py`: a C++ kernel that reads the blocks in place) and `triton`
(`engine/attention/triton_backend.py`: Triton kernels for CUDA). `auto` picks the fastest that
works here: triton on CUDA, cpu on a CPU where the kernel builds, else torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.cache.block_pool import fill_zero
from engine.math_utils import cdiv

logger = logging.getLogger(__name__)

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

    def zero_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> None: ...


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


def write_kv(
    layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
) -> None:
    """Scatter the step's new K and V (`[tokens, kv_heads, dim]`) into their pool slots."""
    heads, dim = key.shape[1], key.shape[2]
    layer_kv[0].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, key)
    layer_kv[1].view(-1, heads, dim).index_copy_(0, batch.slot_mapping, value)


class TorchAttention:
    """The reference backend: plain torch, CPU or GPU.

    Decode tokens (one query per sequence) are attended in one padded batch; prefill chunks
    one sequence at a time, with a lower-right causal mask (queries sit at the end of the
    context). Gathers use `index_select` over K and V together, and the indexing plan is
    built once per step, not once per layer.
    """

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
    """A boolean mask as an additive one (0 or -inf): CPU SDPA runs these about 25% faster."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _starts(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts


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

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")


def make_backend(name: str, device: torch.device, head_dim: int) -> AttentionBackend:
    """An attention backend by name. `auto`: triton on a CUDA device; on a CPU the C++ kernel
    where it builds and fits the model (head_dim a multiple of 16), else torch. A backend
    named explicitly that cannot serve here is a `ValueError` saying why."""
    from engine.attention.cpu_backend import CpuAttention
    from engine.kernels import KernelUnavailable

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; have {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return TorchAttention()
    try:
        if name == "triton" or (name == "auto" and device.type == "cuda"):
            from engine.attention.triton_backend import TritonAttention

            return TritonAttention.create(device)
        return CpuAttention.create(device, head_dim)
    except KernelUnavailable as error:
        if name != "auto":
            raise ValueError(f"attention backend {name!r} is unavailable: {error}") from error
        logger.warning("attention backend: torch (%s)", error)
        return TorchAttention()


def check_backend(name: str, device: torch.device) -> None:
    """Refuse, before a model loads, a backend named explicitly that cannot run on `device`
    (ValueError saying why); head-size limits are checked once the model is known."""
    from engine.attention.cpu_backend import CpuAttention
    from engine.kernels import KernelUnavailable

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; have {', '.join(BACKEND_NAMES)}")
    try:
        if name == "cpu":
            CpuAttention.check(device)
        elif name == "triton":
            from engine.attention.triton_backend import TritonAttention

            TritonAttention.check(device)
    except KernelUnavailable as error:
        raise ValueError(f"attention backend {name!r} is unavailable: {error}") from error
