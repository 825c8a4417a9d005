"""Linear layers on the CPU with weights packed once for oneDNN.

torch's plain `linear` hands the weight over row-major on every call; oneDNN's own blocked
layout, made once at start, is read faster. Measured on SmolLM2's 30 layers of projections:
bf16, one row (decode) 11.2 -> 8.6 ms, prefill-sized products unchanged, results bit-identical;
fp32, one row 26 -> 17 ms, 16 rows 46 -> 18 ms, 1,536 rows 2.2x faster, results equal up to
summation order (relative 1e-5).
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is also kept in oneDNN's packed layout.

    The original `weight` stays a parameter (same tensor, no copy), so `state_dict` and
    copies of the model see the model they loaded.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            # Packed for one row at a time: the decode shape, where the layout pays off.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, self.in_features)
        output: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed, self.bias, "none", [], ""
        )
        return output.reshape(*inputs.shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every fp32 or bf16 CPU `nn.Linear` of `model` for a `PackedLinear`; returns how
    many. Nothing changes without oneDNN, on other devices, or in bf16 where oneDNN has no bf16
    support."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return 0
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype in dtypes
        and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
