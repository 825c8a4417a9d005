"""The `cpu` attention backend: the C++ kernel in `paged_attention.cpp`, reading K/V in place.

Decode, prefill and extend over cached blocks all go through one call per layer; nothing is
gathered out of the pool. The new K/V are written with the same `index_copy_` as the torch
backend, one call per layer for the whole batch.
"""

from __future__ import annotations

import torch

from engine.attention import PagedBatch, write_kv
from engine.kernels import cpu_build
from engine.kernels.cpu_build import KernelUnavailable


class CpuAttention:
    """Paged attention by the C++ CPU kernel."""

    name = "cpu"

    @classmethod
    def create(cls, device: torch.device, head_dim: int) -> CpuAttention:
        """The backend, once it is known to work for this device and head size; else
        `KernelUnavailable` says why."""
        if device.type != "cpu":
            raise KernelUnavailable(f"the C++ kernel runs on the CPU, not {device.type}")
        if head_dim % 16 or head_dim > 256:
            raise KernelUnavailable(f"head_dim {head_dim} is not a multiple of 16 up to 256")
        cpu_build.load()
        return cls()

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None:
        write_kv(layer_kv, key, value, batch)

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        dtype = query.dtype
        if dtype != layer_kv.dtype:  # a KV dtype other than the model's
            query = query.to(layer_kv.dtype)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        torch.ops.prefixgate.paged_attention(
            output,
            query,
            layer_kv[0],
            layer_kv[1],
            batch.block_tables,
            batch.query_starts,
            batch.context_lens_tensor,
            scaling,
            sliding_window or 0,
        )
        return output.to(dtype)
