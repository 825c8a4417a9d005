"""`MatrixLinear` (`matrix_linear.cpp`): bf16 projections and the LM head's fp32 logits on the
CPU's bf16 matrix micro-kernels, against float64 products of the same bf16 operands; one order
of arithmetic for every row count and thread count, bit for bit; and its refusals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import huge_pages
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.linear import (
    MatrixLinear,
    PackedLinear,
    gather_packed_weights,
    matrix_linear,
    pack_linears,
)
from engine.model.cpu_decoder import project
from tests.support import matrix_products
from tests.support.models import engine_for, loaded, tiny_model

cpu_build.load()
if matrix_linear(torch.nn.Linear(32, 32).to(torch.bfloat16)) is None:
    pytest.skip(
        "this CPU has no bf16 matrix products (AMX, AVX512_BF16, AVX2)", allow_module_level=True
    )


@pytest.fixture(params=["amx", "dot"], autouse=True)
def products(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test on each kind of bf16 products this CPU has."""
    yield from matrix_products.take(request.param)


def bf16_linear(inputs: int, outputs: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 16, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_outputs_equal_a_float64_product_of_the_bf16_operands(rows: int, bias: bool) -> None:
    head = bf16_linear(96, 1000, bias)  # 1,000 outputs: a partial last tile
    hidden = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    hidden = hidden.to(torch.bfloat16)
    logits = MatrixLinear(head, fp32_out=True)(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
    exact = hidden.double() @ head.weight.double().T
    if bias:
        exact += head.bias.double()
    torch.testing.assert_close(logits.double(), exact, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inputs", [96, 48])  # 48: not a multiple of the 32 a product step takes
def test_bf16_outputs_are_the_float64_product_rounded_once(bias: bool, inputs: int) -> None:
    linear = bf16_linear(inputs, 1000, bias)
    values = torch.randn(2, 37, inputs, generator=torch.Generator().manual_seed(1))
    values = values.to(torch.bfloat16)
    output = MatrixLinear(linear)(values)
    assert output.dtype == torch.bfloat16 and output.shape == (2, 37, 1000)
    exact = values.double() @ linear.weight.double().T
    if bias:
        exact += linear.bias.double()
    # fp32 sums (relative error ~1e-6 here), then one rounding to bf16: at most half an ulp,
    # 2^-8 relative (8 significant bits).
    torch.testing.assert_close(output.double(), exact, atol=1e-5, rtol=2**-8 + 1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(
    one_thread: None,
) -> None:
    # 1,536 inputs: SmolLM2's down projection, where oneDNN's own matmul gave a row other bits
    # at 130-300 rows than alone. 600 rows: three groups of 256, the last one partial.
    linear = MatrixLinear(bf16_linear(1536, 576, bias=True))
    inputs = torch.randn(600, 1536, generator=torch.Generator().manual_seed(2))
    inputs = inputs.to(torch.bfloat16)
    one_thread_output = linear(inputs)
    torch.set_num_threads(2)
    everything = linear(inputs)
    assert torch.equal(everything, one_thread_output)
    for rows in (1, 2, 17, 33, 130, 257, 300):
        assert torch.equal(linear(inputs[:rows]), everything[:rows]), rows
    for row in (0, 255, 256, 599):
        assert torch.equal(linear(inputs[row : row + 1]), everything[row : row + 1]), row
    narrow = MatrixLinear(bf16_linear(48, 100, bias=True))  # a partial tile, 48 inputs
    everything = narrow(inputs[:, :48].contiguous())
    for rows in (1, 5, 40, 300):
        assert torch.equal(narrow(inputs[:rows, :48].contiguous()), everything[:rows]), rows


def test_the_decoders_direct_call_computes_what_the_module_does() -> None:
    linear = MatrixLinear(bf16_linear(96, 200, bias=True))
    wide = torch.randn(7, 2 * 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    rows = wide[:, :96]  # not contiguous: project takes the module's path
    expected = linear(rows.contiguous())
    assert torch.equal(linear.rows(rows.contiguous(), fp32_out=False), expected)
    assert torch.equal(project(linear, rows), expected)
    assert torch.equal(project(linear, rows.contiguous()), expected)
    head = MatrixLinear(bf16_linear(96, 200, bias=False), fp32_out=True)
    logits = project(head, rows.contiguous())
    assert logits.dtype == torch.float32 and torch.equal(logits, head(rows))
    # Not rows ([2, 7, 96]): the module's path, each row the same bits as alone.
    batched = torch.stack([rows.contiguous(), rows.flip(0).contiguous()])
    output = project(linear, batched)
    assert output.shape == (2, 7, 200)
    for index in range(7):
        assert torch.equal(output[1, index], linear(batched[1, index : index + 1])[0])


@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_product_is_gated_silu_of_the_product_bit_for_bit(bias: bool) -> None:
    # A fused gate-and-up projection (two halves of 192 outputs, three tiles each).
    linear = MatrixLinear(bf16_linear(96, 384, bias))
    inputs = torch.randn(300, 96, generator=torch.Generator().manual_seed(3))
    inputs = inputs.to(torch.bfloat16)
    for rows in (1, 7, 300):
        gated = linear.gated_silu(inputs[:rows])
        assert gated.shape == (rows, 192)
        assert torch.equal(gated, torch.ops.prefixgate.gated_silu(linear(inputs[:rows])))


def test_a_packed_weight_another_shape_or_a_bad_bias_is_refused() -> None:
    packed = torch.ops.prefixgate.pack_matrix_weight(torch.zeros(100, 32, dtype=torch.bfloat16))
    matrix_linear = torch.ops.prefixgate.matrix_linear
    hidden = torch.zeros(2, 32, dtype=torch.bfloat16)
    for out in (64, 129):  # 100 outputs make two tiles of 64: 65-128 fit
        with pytest.raises(RuntimeError, match="does not match"):
            matrix_linear(hidden, packed, None, out, False)
    with pytest.raises(RuntimeError, match="does not match"):
        matrix_linear(torch.zeros(2, 48, dtype=torch.bfloat16), packed, None, 100, False)
    with pytest.raises(RuntimeError, match="does not match"):  # an fp32 input, a bf16 weight
        matrix_linear(hidden.float(), packed, None, 100, False)
    with pytest.raises(RuntimeError, match="contiguous bf16 or fp32"):
        matrix_linear(hidden.half(), packed, None, 100, False)
    for bias in (torch.zeros(99), torch.zeros(100, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="fp32 vector of `out` values"):
            matrix_linear(hidden, packed, bias, 100, False)
    gated = torch.ops.prefixgate.pack_matrix_weight(torch.zeros(192, 32, dtype=torch.bfloat16))
    for out, fp32_out in ((192, False), (128, True)):  # halves of 96: not whole tiles
        with pytest.raises(RuntimeError, match="gated product"):
            matrix_linear(hidden, gated if out == 192 else packed, None, out, fp32_out, True)
    with pytest.raises(RuntimeError, match="even `in`"):
        torch.ops.prefixgate.pack_matrix_weight(torch.zeros(4, 31, dtype=torch.bfloat16))


def test_every_bf16_projection_goes_to_the_matrix_kernel_without_timing() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    assert pack_linears(model) == {}  # no plan measured
    swapped = [module for module in model.modules() if isinstance(module, MatrixLinear)]
    assert len(swapped) == 2 * 7 + 1  # two layers' seven projections and the LM head
    others = (PackedLinear, torch.nn.Linear)
    assert not any(isinstance(module, others) for module in model.modules())
    assert all(not module.fp32_out for module in swapped)
    fp32 = tiny_model("llama")
    pack_linears(fp32)
    fp32_matrix = any(isinstance(module, MatrixLinear) for module in fp32.modules())
    assert fp32_matrix == fp32_products()


def test_packed_weights_move_into_one_buffer_and_compute_the_same_bits() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    pack_linears(model)
    linears = [module for module in model.modules() if isinstance(module, MatrixLinear)]
    hidden = torch.randn(5, linears[0].in_features).to(torch.bfloat16)
    before = [linear(hidden) for linear in linears if linear.in_features == hidden.shape[1]]
    gather_packed_weights(model)
    buffers = {linear.packed.untyped_storage().data_ptr() for linear in linears}
    assert len(buffers) == 1 and all(linear.gathered for linear in linears)
    assert all(linear.packed.data_ptr() % 64 == 0 for linear in linears)
    after = [linear(hidden) for linear in linears if linear.in_features == hidden.shape[1]]
    assert len(after) > 1 and all(map(torch.equal, before, after))
    where = [linear.packed.data_ptr() for linear in linears]
    gather_packed_weights(model)  # a runner made again: nothing moves
    assert [linear.packed.data_ptr() for linear in linears] == where


def test_packed_weights_of_a_few_megabytes_start_on_a_huge_page() -> None:
    model = torch.nn.Sequential(bf16_linear(1024, 2048, True), bf16_linear(2048, 96, False, 1))
    pack_linears(model)
    hidden = torch.randn(3, 1024).to(torch.bfloat16)
    before = model(hidden)
    gather_packed_weights(model)
    first, second = model[0].packed, model[1].packed  # 4 MB and 384 KB
    assert first.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.equal(model(hidden), before)


def fp32_products() -> bool:
    """Whether fp32 linear layers run on the matrix kernel here (AVX2 without AVX-512)."""
    return matrix_linear(torch.nn.Linear(32, 32)) is not None


def test_the_engine_says_which_kernel_runs_its_projections() -> None:
    expected = "matrix" if fp32_products() else "library"
    assert engine_for("llama").describe()["linear_kernel"] == expected  # fp32
    bf16 = Engine(loaded(tiny_model("llama").to(torch.bfloat16)), EngineConfig(num_blocks=64))
    assert bf16.describe()["linear_kernel"] == "matrix"
