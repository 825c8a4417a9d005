"""fp32 logits for a bf16 model on the CPU (the C++ kernel in `logits_head.cpp`).

A bf16 LM head rounds its logits to bf16: near 25 that is steps of 0.125, so near-ties between
the top tokens are decided by rounding, and greedy decoding follows whichever way it fell.
`LogitsHead` keeps the weight in bf16 (read once per step, as before) and sums and returns the
logits in fp32.
"""

from __future__ import annotations

import torch

from engine.kernels import KernelUnavailable, cpu_build


class LogitsHead(torch.nn.Module):
    """An LM head (`nn.Linear` without bias, bf16, on the CPU) with fp32 logits.

    The weight is packed once, here: the model's weights are frozen while it serves. The packed
    copy is a second copy of the head's weight (the original stays, tied to the embeddings).
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same tensor: tied embeddings stay tied
        with torch.no_grad():
            self.packed = torch.ops.prefixgate.pack_logits_weight(linear.weight.detach())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).contiguous()
        logits: torch.Tensor = torch.ops.prefixgate.logits_fp32(
            rows, self.packed, self.out_features
        )
        return logits.reshape(*hidden.shape[:-1], self.out_features)


def fp32_logits(model: torch.nn.Module) -> bool:
    """Give a bf16 CPU model's LM head fp32 logits where the CPU kernels can; returns whether
    it did (the head keeps bf16 logits otherwise)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LogitsHead):  # a runner made again for the same model (a restart)
        return True
    if not (
        type(head) is torch.nn.Linear
        and head.bias is None
        and head.weight.dtype == torch.bfloat16
        and head.weight.device.type == "cpu"
        and head.in_features % 2 == 0
    ):
        return False
    try:
        cpu_build.load()
        model.lm_head = LogitsHead(head)
    except (KernelUnavailable, RuntimeError):  # no build, or no bf16 micro-kernels here
        return False
    return True
