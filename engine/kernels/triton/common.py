"""What the Triton attention kernels share: the product helper, key loads and softmax step.

Triton's interpreter (`TRITON_INTERPRET=1`, how the kernels are tested on a CPU) miscomputes
`tl.dot` on bf16 operands, so there the operands are widened to fp32 first. That changes no
result: a bf16 x bf16 product is exact in fp32, and the kernels round the softmax weights to
the value dtype before the product either way.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_positions(
    base, table, positions, valid, dim_mask, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr
):
    """K or V rows `[positions, dims]` of one KV head, each position's block looked up in the
    sequence's block table (`base` already points at the head and the dims)."""
    blocks = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = positions % BLOCK_SIZE
    return tl.load(
        base + blocks[:, None] * stride_block + slots[:, None] * stride_slot,
        mask=valid[:, None] & dim_mask[None, :],
        other=0.0,
    )


@triton.jit
def softmax_step(scores, value, best, total, acc, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """One tile of the online softmax, base 2: fold `scores` (-inf where not visible) and their
    `value` rows into the running max `best`, sum `total` and output `acc`."""
    new_best = tl.maximum(best, tl.max(scores, 1))
    # A row that has seen nothing yet keeps -inf: subtract 0 so that exp2 gives 0, not NaN.
    safe_best = tl.where(new_best == float("-inf"), 0.0, new_best)
    probs = tl.exp2(scores - safe_best[:, None])
    rescale = tl.exp2(best - safe_best)
    total = total * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + dot(probs.to(value.dtype), value, PRECISION, WIDEN)
    return new_best, total, acc


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def product_options(dtype: torch.dtype) -> dict[str, object]:
    """`PRECISION` and `WIDEN` for `dot` on operands of `dtype`: fp32 products in full
    precision, not tf32 (the fp32 engine must match the reference)."""
    precision = "ieee" if dtype == torch.float32 or interpreting() else "tf32"
    return {"PRECISION": precision, "WIDEN": interpreting()}


def key_tile(head_dim: int, dtype: torch.dtype) -> int:
    """Key positions per iteration: 64, or 32 where one K row passes 512 bytes (fp32 heads
    over 128), so that the tiles fit an A100's shared memory."""
    return 64 if triton.next_power_of_2(head_dim) * dtype.itemsize <= 512 else 32
