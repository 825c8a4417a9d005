"""Logits on the CPU: fp32 logits for a bf16 model (an fp32 model's head on the same kernel),
and the sampler's pass over them.

A bf16 LM head rounds its logits to bf16: near 25 that is steps of 0.125, so near-ties between
the top tokens are decided by rounding, and greedy decoding follows whichever way it fell. The
head keeps its weight in bf16 (read once per step, as before) and sums and returns the logits
in fp32 (`MatrixLinear` with `fp32_out`, in `engine.kernels.cpu.linear`).

`argmax_finite` gives the sampler each row's argmax and whether the row is finite in one pass
(`logits_rows.cpp`) where the CPU kernels are loaded, instead of torch's six passes.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.linear import MatrixLinear, matrix_linear


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` ([rows, vocab]): the index of its greatest value (the first of equal
    ones; unspecified for a row that is not all finite) and whether the row is all finite."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
        and hasattr(torch.ops.prefixgate, "argmax_finite")  # the kernels are loaded
    ):
        best, finite = torch.ops.prefixgate.argmax_finite(logits)
        return best, finite
    return logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1)


def fp32_logits(model: torch.nn.Module) -> bool:
    """Put a CPU model's LM head on `MatrixLinear` with fp32 logits where the CPU kernels can (a
    bf16 head's would be rounded to bf16; an fp32 head sums in one order there too); returns
    whether it did (a bf16 head keeps bf16 logits otherwise)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, MatrixLinear):  # a runner made again for the same model (a restart)
        return head.fp32_out
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    swapped = matrix_linear(head, fp32_out=True)
    if swapped is None:
        return False
    model.lm_head = swapped
    return True
