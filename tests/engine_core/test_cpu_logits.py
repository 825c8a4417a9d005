"""The bf16 LM head with fp32 logits (`logits_head.cpp`) against a float64 product, and its
refusals."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_build
from engine.kernels.cpu_logits import LogitsHead

cpu_build.load()
if not torch.ops.prefixgate.use_matrix_units(True):
    pytest.skip("this CPU has no bf16 matrix micro-kernels", allow_module_level=True)


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 37])
def test_logits_equal_a_float64_product_of_the_bf16_operands(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    head = torch.nn.Linear(96, 1000, bias=False).to(torch.bfloat16)  # 1,000: a partial tile
    hidden = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    logits = LogitsHead(head)(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
    exact = hidden.double() @ head.weight.double().T
    torch.testing.assert_close(logits.double(), exact, atol=1e-5, rtol=1e-6)


def test_a_packed_weight_for_another_shape_is_refused() -> None:
    packed = torch.ops.prefixgate.pack_logits_weight(torch.zeros(100, 32, dtype=torch.bfloat16))
    hidden = torch.zeros(2, 32, dtype=torch.bfloat16)
    for out in (64, 129):  # 100 outputs make two tiles of 64: 65-128 fit
        with pytest.raises(RuntimeError, match="does not match"):
            torch.ops.prefixgate.logits_fp32(hidden, packed, out)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.prefixgate.logits_fp32(torch.zeros(2, 48, dtype=torch.bfloat16), packed, 100)
