"""`MatrixLinear` on fp32 weights (`fp32_product.h`, AVX2 without AVX-512): close to float64
products of the same operands, one order of arithmetic for every row count and thread count
bit for bit, the depth in several passes giving the bits of one, and a fused gate-and-up
projection equal to `gated_silu` of the plain product."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.linear import MatrixLinear, matrix_linear
from engine.precision import cpu_flags

cpu_build.load()
if not {"avx2", "fma"} <= cpu_flags() or "avx512f" in cpu_flags():
    pytest.skip("fp32 matrix products are built for AVX2 without AVX-512", allow_module_level=True)


def test_this_cpu_has_them() -> None:
    assert matrix_linear(torch.nn.Linear(32, 32)) is not None


def fp32_linear(inputs: int, outputs: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 16, 37])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inputs", [1, 3, 96, 200])  # 200: a depth pass of 128, then one of 72
def test_outputs_equal_a_float64_product_of_the_operands(
    rows: int, bias: bool, inputs: int
) -> None:
    linear = fp32_linear(inputs, 1000, bias)  # 1,000 outputs: a partial last tile
    hidden = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
    output = MatrixLinear(linear)(hidden)
    assert output.dtype == torch.float32 and output.shape == (rows, 1000)
    exact = hidden.double() @ linear.weight.double().T
    if bias:
        exact += linear.bias.double()
    torch.testing.assert_close(output.double(), exact, atol=1e-5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(
    one_thread: None,
) -> None:
    # 1,536 inputs (SmolLM2's down projection): twelve passes over the depth. 600 rows: three
    # groups of 256, the last one partial, in blocks of 6 and the rest.
    linear = MatrixLinear(fp32_linear(1536, 576, bias=True))
    inputs = torch.randn(600, 1536, generator=torch.Generator().manual_seed(2))
    one_thread_output = linear(inputs)
    torch.set_num_threads(2)
    everything = linear(inputs)
    assert torch.equal(everything, one_thread_output)
    for rows in (1, 2, 3, 5, 17, 33, 130, 257, 300):
        assert torch.equal(linear(inputs[:rows]), everything[:rows]), rows
    for row in (0, 5, 6, 255, 256, 599):
        assert torch.equal(linear(inputs[row : row + 1]), everything[row : row + 1]), row


def test_the_depth_in_passes_sums_in_the_order_of_one_chain() -> None:
    # One output is a chain of FMAs over the inputs in order: a float32 loop that rounds once
    # after each multiply-add (torch has no fused multiply-add: the product of two floats is
    # exact in float64, and their float64 sum rounded to float32 is the FMA's result unless the
    # float64 rounding itself lands on a float32 tie, which these values never do).
    linear = fp32_linear(300, 64, bias=False)
    hidden = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    output = MatrixLinear(linear)(hidden)
    weight = linear.weight.double()
    chain = torch.zeros(3, 64, dtype=torch.float32)
    for k in range(300):
        exact = chain.double() + hidden[:, k : k + 1].double() * weight[:, k]
        chain = exact.float()
    assert torch.equal(output, chain)


@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_product_is_gated_silu_of_the_product_bit_for_bit(bias: bool) -> None:
    linear = MatrixLinear(fp32_linear(200, 384, bias))  # halves of 192: three tiles each
    inputs = torch.randn(300, 200, generator=torch.Generator().manual_seed(3))
    for rows in (1, 2, 7, 300):
        gated = linear.gated_silu(inputs[:rows])
        assert gated.shape == (rows, 192) and gated.dtype == torch.float32
        assert torch.equal(gated, torch.ops.prefixgate.gated_silu(linear(inputs[:rows])))


def test_a_packed_weight_of_another_dtype_or_shape_is_refused() -> None:
    packed = torch.ops.prefixgate.pack_matrix_weight(torch.zeros(100, 32))
    product = torch.ops.prefixgate.matrix_linear
    hidden = torch.zeros(2, 32)
    assert product(hidden, packed, None, 100, False).shape == (2, 100)
    for out in (64, 129):
        with pytest.raises(RuntimeError, match="does not match"):
            product(hidden, packed, None, out, False)
    with pytest.raises(RuntimeError, match="does not match"):
        product(hidden.to(torch.bfloat16), packed, None, 100, False)
    with pytest.raises(RuntimeError, match="does not match"):
        product(torch.zeros(2, 48), packed, None, 100, False)
    with pytest.raises(RuntimeError, match="gated product"):
        product(hidden, packed, None, 100, False, True)  # halves of 50: not whole tiles
