"""The fused RMSNorm and SiLU-and-multiply against transformers' own modules, and the swap.

bf16: equal bit for bit (they round where transformers' bf16 ops round). fp32: within 1e-5
(summation order of the mean, the last bits of exp).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.fused import FusedMLP, FusedRMSNorm, fuse_elementwise
from tests.support.models import ARCHITECTURES, tiny_model

cpu_build.load()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.0}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=generator)
    norm = norm.to(dtype)
    hidden = (torch.randn(1, 37, 576, generator=generator) * 4).to(dtype)
    expected, fused = norm(hidden), FusedRMSNorm(norm)(hidden)
    assert fused.shape == expected.shape and fused.dtype == dtype
    torch.testing.assert_close(fused, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@DTYPES
def test_silu_and_mul_matches_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160)).to(dtype)
    # Large gates of both signs: exp must neither overflow nor lose the sign.
    hidden = (torch.randn(1, 21, 64) * 30).to(dtype)
    expected, fused = mlp(hidden), FusedMLP(mlp)(hidden)
    torch.testing.assert_close(fused, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_swap_keeps_parameters_and_output(architecture: str) -> None:
    model = tiny_model(architecture)
    names = list(model.state_dict())
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        layers = model.config.num_hidden_layers
        assert fuse_elementwise(model) == 3 * layers + 1  # two norms and an MLP per layer
        assert list(model.state_dict()) == names
        fused = model(input_ids=ids).logits
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


def test_a_model_off_the_cpu_or_in_another_dtype_is_left_alone() -> None:
    model = tiny_model("llama").to(torch.float16)
    assert fuse_elementwise(model) == 0


def test_nan_stays_nan_in_bf16() -> None:
    # Rounding to bf16 must not carry a NaN's payload into the exponent (that gives infinity).
    norm = FusedRMSNorm(LlamaRMSNorm(32).to(torch.bfloat16))
    hidden = torch.ones(2, 32, dtype=torch.bfloat16)
    hidden[0, 3] = float("nan")
    output = norm(hidden)
    assert output[0].isnan().all()  # the row's mean is NaN
    assert output[1].isfinite().all()
