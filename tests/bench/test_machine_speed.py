"""bench/machine_speed.py: the probe's rates are its work over its times."""

from __future__ import annotations

import math

import pytest
import torch

from bench import machine_speed
from bench.machine_speed import Prober, Speed, product_dtype, rates, summary, typical


def test_rates_are_the_work_over_the_time() -> None:
    # 2 x 4 x 8 x 16 = 1,024 FLOP in 1 ns: 1.024 TFLOP/s; 1,000 bytes read and written in 1 us,
    # read alone in 0.25 us.
    speed = rates((4, 8, 16), 1e-9, 1000, 1e-6, 0.25e-6)
    assert speed.matmul_tflops == pytest.approx(1.024)
    assert speed.memory_gb_s == pytest.approx(2.0)
    assert speed.read_gb_s == pytest.approx(4.0)


def test_a_probe_times_its_own_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_speed, "MATMUL_BUDGET_S", 0.01)
    prober = Prober(torch.float32, (64, 32, 16), 1 << 20)  # small: this is not a benchmark
    assert prober.describe() == "64x32x16 float32"
    speed = prober.probe()
    assert math.isfinite(speed.matmul_tflops) and speed.matmul_tflops > 0
    assert math.isfinite(speed.memory_gb_s) and speed.memory_gb_s > 0
    assert math.isfinite(speed.read_gb_s) and speed.read_gb_s > 0
    assert torch.equal(prober.buffer, torch.ones(1 << 18))  # passes leave the values alone


def test_summary_gives_least_median_and_most_of_each_rate() -> None:
    speeds = [Speed(2.0, 20.0, 12.0), Speed(1.0, 25.0, 11.0), Speed(0.012345, 10.0, 13.0)]
    assert summary(speeds) == {
        "matmul_tflops": [0.0123, 1.0, 2.0],  # three significant digits, however small
        "memory_gb_s": [10.0, 20.0, 25.0],
        "read_gb_s": [11.0, 12.0, 13.0],
    }
    assert typical(speeds) == Speed(1.0, 20.0, 12.0)  # each rate's median, unrounded
    assert typical(speeds[1:]) == Speed((1.0 + 0.012345) / 2, 17.5, 12.0)


def test_the_product_is_bf16_only_where_the_cpu_computes_bf16_natively() -> None:
    assert product_dtype(torch.bfloat16, native_bf16=True) == torch.bfloat16
    assert product_dtype(torch.bfloat16, native_bf16=False) == torch.float32
    assert product_dtype(torch.float32, native_bf16=True) == torch.float32
