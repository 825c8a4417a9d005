"""fp32 logits for a bf16 model on the CPU (`MatrixLinear` with `fp32_out`, in `cpu_linear`).

A bf16 LM head rounds its logits to bf16: near 25 that is steps of 0.125, so near-ties between
the top tokens are decided by rounding, and greedy decoding follows whichever way it fell. The
head keeps its weight in bf16 (read once per step, as before) and sums and returns the logits
in fp32.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_linear import MatrixLinear, matrix_linear


def fp32_logits(model: torch.nn.Module) -> bool:
    """Give a bf16 CPU model's LM head fp32 logits where the CPU kernels can; returns whether
    it did (the head keeps bf16 logits otherwise)."""
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
