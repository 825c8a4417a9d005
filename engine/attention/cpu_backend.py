"""The `cpu` attention backend: the C++ kernel in `paged_attention.cpp`, reading K/V in place.

Decode, prefill and extend over cached blocks all go through one call per layer; nothing is
gathered out of the pool. Where the CPU has bf16 matrix products (AMX, AVX512_BF16, or AVX2's
FMA), bf16 prefill and extend run as matrix products (`paged_attention_matrix.cpp`). The new
K/V are written by `kv_write.cpp`, one call per layer for the whole batch (what the torch
backend's two `index_copy_` calls do, in less time), and freed blocks zeroed with the torch
backend's `index_fill_`.
"""

from __future__ import annotations

import torch

from engine.attention.paged import PagedBatch
from engine.cache.block_pool import fill_zero
from engine.kernels import KernelUnavailable
from engine.kernels.cpu import build as cpu_build


class CpuAttention:
    """Paged attention by the C++ CPU kernel."""

    name = "cpu"

    @staticmethod
    def check(device: torch.device) -> None:
        """Raise `KernelUnavailable` unless the kernel is built and runs on `device`."""
        if device.type != "cpu":
            raise KernelUnavailable(f"the C++ kernel runs on the CPU, not {device.type}")
        cpu_build.load()

    @classmethod
    def create(cls, device: torch.device, head_dim: int) -> CpuAttention:
        """The backend, once it is known to work for this device and head size; else
        `KernelUnavailable` says why."""
        if head_dim % 16 or head_dim > 256:
            raise KernelUnavailable(f"head_dim {head_dim} is not a multiple of 16 up to 256")
        cls.check(device)
        # Matrix products for bf16 prefill and shared prefixes wherever the CPU has them
        # (bf16_product.h): faster on AMX and AVX512_BF16, and on AVX2's FMA faster for
        # shared prefixes, with a prompt rounding the same whether its beginning came from
        # the cache or not.
        torch.ops.prefixgate.use_matrix_units(True)
        return cls()

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None:
        torch.ops.prefixgate.write_kv(layer_kv[0], layer_kv[1], key, value, batch.slot_mapping)

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
            batch.share_groups,
            batch.prompt_chunks,
        )
        return output.to(dtype)
