"""The `triton` attention backend: the Triton kernels for KV writes, paged attention and block
zeroing, on a CUDA device (or on CPU tensors in Triton's interpreter, `TRITON_INTERPRET=1`,
which is how they are tested without a GPU).

Nothing here reads the device: kernel grids and decode splits come from the step's lengths,
which the host already has, so a layer launches its kernels without waiting on the GPU. How a
decoding sequence's context is split depends on that sequence alone (`decode`'s docstring), so
its output does not change with what shares its step; the batch sets only the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.paged import PagedBatch
from engine.kernels import KernelUnavailable
from engine.kernels.triton.common import interpreting
from engine.kernels.triton.decode import decode_attention, plan_splits
from engine.kernels.triton.kv_write import write_kv
from engine.kernels.triton.prefill import prefill_attention
from engine.kernels.triton.zero import zero_blocks


@dataclass(frozen=True, slots=True)
class _Plan:
    """One step's launch shapes, shared by every layer with the same sliding window."""

    decode_splits: int | None  # the decode grid's split dimension; None: no sequence decodes
    longest_prefill: int  # 0: no sequence prefills this step


class TritonAttention:
    """Paged attention by the Triton kernels."""

    name = "triton"

    @staticmethod
    def check(device: torch.device) -> None:
        """Raise `KernelUnavailable` unless the kernels can run on `device`."""
        if device.type == "cuda" or (device.type == "cpu" and interpreting()):
            return
        raise KernelUnavailable(
            f"the Triton kernels need a CUDA device, not {device.type} "
            "(on a CPU they run only in Triton's interpreter, TRITON_INTERPRET=1, for tests)"
        )

    @classmethod
    def create(cls, device: torch.device) -> TritonAttention:
        """The backend, where its kernels can run; else `KernelUnavailable` says why."""
        cls.check(device)
        return cls()

    def write(
        self, layer_kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch
    ) -> None:
        write_kv(layer_kv[0], layer_kv[1], key, value, batch.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: PagedBatch,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        window = sliding_window or 0
        plan = batch.plans.get(window)
        if plan is None:
            plan = batch.plans[window] = _make_plan(batch, window)
        dtype = query.dtype
        if dtype != layer_kv.dtype:  # a KV dtype other than the model's
            query = query.to(layer_kv.dtype)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        tensors = (
            query,
            layer_kv[0],
            layer_kv[1],
            batch.block_tables,
            batch.query_starts,
            batch.context_lens_tensor,
            scaling,
            window,
        )
        if plan.decode_splits is not None:
            decode_attention(output, *tensors, plan.decode_splits)
        if plan.longest_prefill:
            prefill_attention(output, *tensors, plan.longest_prefill)
        return output.to(dtype)

    def zero_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> None:
        zero_blocks(kv, block_ids)


def _make_plan(batch: PagedBatch, window: int) -> _Plan:
    decode_spans = [
        min(context, window) if window else context
        for query_len, context in zip(batch.query_lens, batch.context_lens, strict=True)
        if query_len == 1
    ]
    splits = plan_splits(decode_spans) if decode_spans else None
    longest = max(batch.query_lens)
    return _Plan(splits, longest if longest > 1 else 0)
