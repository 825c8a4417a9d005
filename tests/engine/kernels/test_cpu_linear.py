"""`PackedLinear`: each row class on the path its plan chose, with the same results either way."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.linear import (
    LARGE_ROWS_MAX_WEIGHT,
    NO_PRODUCTS,
    LinearPlan,
    PackedLinear,
    measure_plan,
    pack_linears,
    rows_to_time,
)
from tests.support.models import tiny_model


@pytest.mark.parametrize(
    "packed",
    [(False, False, False, False), (True, True, True, True), (False, True, False, True)],
    ids=str,
)
def test_every_row_class_gives_the_linear_result_on_either_path(
    packed: tuple[bool, bool, bool, bool],
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80)
    swapped = PackedLinear(linear, LinearPlan(packed))
    assert (swapped.packed is None) == (not any(packed))  # no second copy it never reads
    with torch.inference_mode():
        for rows in (1, 5, 32, 33, 200, 300):
            inputs = torch.randn(2, rows, 96)
            torch.testing.assert_close(swapped(inputs), linear(inputs), atol=1e-5, rtol=1e-5)


def test_row_classes_split_at_one_thirty_two_and_256_rows() -> None:
    plan = LinearPlan((True, False, True, False))
    assert [plan.packed_for(rows) for rows in (1, 2, 32, 33, 256, 257, 4096)] == [
        True, False, False, True, True, False, False,
    ]  # fmt: skip


def test_a_weight_too_large_to_time_at_many_rows_is_timed_up_to_64() -> None:
    lm_head = torch.empty(49152, 576, device="meta")  # SmolLM2's: seconds at 1,024 rows
    assert lm_head.numel() > LARGE_ROWS_MAX_WEIGHT
    assert rows_to_time(lm_head) == (1, 16, 64)
    assert rows_to_time(torch.empty(3072, 576, device="meta")) == (1, 16, 64, 1024)


def test_the_refusals_recognized_are_the_kernels_own_words() -> None:
    # matrix_linear() tells "no products for this dtype here" (None: torch's paths) from other
    # errors by these strings; a CPU without the products is the only place they show.
    headers = [cpu_build.source_file(name).read_text() for name in cpu_build.HEADERS]
    assert all(any(f'"{reason}"' in text for text in headers) for reason in NO_PRODUCTS)


def test_the_model_gets_one_measured_plan_per_weight_shape() -> None:
    model = tiny_model("llama")
    # Without the matrix kernel: fp32 takes MatrixLinear where the CPU has AVX2 products.
    plans = pack_linears(model, matrix_kernel=False)
    # q and o, k and v, gate and up, down, and the LM head: five shapes.
    assert set(plans) == {(64, 64), (32, 64), (128, 64), (64, 128), (512, 64)}
    swapped = [module for module in model.modules() if isinstance(module, PackedLinear)]
    assert len(swapped) == 2 * 7 + 1
    assert all(
        module.plan is plans[(module.out_features, module.in_features)] for module in swapped
    )
    assert isinstance(measure_plan(torch.randn(16, 16), None), LinearPlan)
