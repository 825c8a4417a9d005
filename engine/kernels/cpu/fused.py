"""Fused RMSNorm and SiLU-and-multiply for transformers models on the CPU (`elementwise.cpp`).

transformers' `LlamaRMSNorm` runs six torch ops (to fp32, pow, mean, add, rsqrt, mul, to dtype,
mul) and its MLP a separate SiLU and multiply; each op is a pass over the data and, in decode,
a dispatch that costs more than its arithmetic. The swaps here keep the modules' parameters
(same tensors, same names), so `state_dict` and copies of the model see what was loaded. Only
the RMSNorm classes whose forward is exactly Llama's are swapped (Gemma's, with `1 + weight`,
is not), and only MLPs whose activation is SiLU.
"""

from __future__ import annotations

import torch

from engine.kernels import KernelUnavailable
from engine.kernels.cpu import build as cpu_build

# RMSNorm classes computing weight * to_dtype(x * rsqrt(mean(x^2) + eps)) in fp32.
_LLAMA_STYLE_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_DTYPES = (torch.float32, torch.bfloat16)


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm in one pass per row."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        epsilon = norm.variance_epsilon
        assert isinstance(epsilon, float | int)
        self.variance_epsilon = float(epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        output: torch.Tensor = torch.ops.prefixgate.rms_norm(
            rows, self.weight, self.variance_epsilon
        )
        return output.view(hidden.shape)


class FusedMLP(torch.nn.Module):
    """A gated MLP (`down(silu(gate(x)) * up(x))`) with the SiLU and product in one pass."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj: torch.nn.Module = mlp.get_submodule("gate_proj")
        self.up_proj: torch.nn.Module = mlp.get_submodule("up_proj")
        self.down_proj: torch.nn.Module = mlp.get_submodule("down_proj")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(hidden)
        up = self.up_proj(hidden)
        width = gate.shape[-1]
        activated = torch.ops.prefixgate.silu_and_mul(
            gate.reshape(-1, width).contiguous(), up.reshape(-1, width).contiguous()
        )
        down: torch.Tensor = self.down_proj(activated.view(gate.shape))
        return down


def _fusable_norm(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in _LLAMA_STYLE_NORMS
        and isinstance(weight, torch.Tensor)
        and weight.dtype == dtype  # the kernel takes the activations' dtype
        and weight.dim() == 1
        and weight.shape[0] % 16 == 0
        and hasattr(module, "variance_epsilon")
    )


def _fusable_mlp(module: torch.nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    activation = getattr(module, "act_fn", None)
    return (
        all(isinstance(part, torch.nn.Module) for part in parts)
        and type(activation).__name__ == "SiLUActivation"
        and getattr(parts[0], "out_features", 1) % 16 == 0
    )


def fuse_elementwise(model: torch.nn.Module) -> int:
    """Swap `model`'s Llama-style RMSNorms and SiLU MLPs for the fused ones when the model is
    on the CPU in fp32 or bf16 and the kernels are built; returns how many were swapped."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype not in _DTYPES:
        return 0
    try:
        cpu_build.load()
    except KernelUnavailable:
        return 0
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _fusable_norm(child, parameter.dtype):
                swaps.append((parent, name, FusedRMSNorm(child)))
            elif _fusable_mlp(child):
                swaps.append((parent, name, FusedMLP(child)))
    for parent, name, fused in swaps:
        setattr(parent, name, fused)
    return len(swaps)
