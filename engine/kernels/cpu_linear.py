"""bf16 linear layers on the CPU with weights packed once for oneDNN.

torch's plain `linear` hands oneDNN a row-major bf16 weight on every call; oneDNN's own
blocked layout, made once at start, reads it faster: a decode step's projections (one row per
sequence, bound by reading the weights) took about 25% less time in
`bench/peers.py`'s workload, prefill-sized products the same. The results are bit-identical.
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose bf16 weight is also kept in oneDNN's packed layout.

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
    """Swap every bf16 CPU `nn.Linear` of `model` for a `PackedLinear`; returns how many.

    Nothing changes where oneDNN has no bf16 support, on other devices or in fp32.
    """
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not (mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
